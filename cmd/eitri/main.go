// Command eitri is the one binary: the control plane (server), the host
// agent (agent), both at once for development (dev), and the client
// commands (login, vm, host, expose, token, quota, ssh, tunnel,
// port-forward), which live in package cli. This package wires the first
// three and parses their flags.
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/pprof"
	"syscall"

	"github.com/a73x/eitri/agent/upgrade"
	"github.com/a73x/eitri/cmd/eitri/cli"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

func main() {
	// Started as the guard of a new agent build: nothing else runs.
	if ran, code := upgrade.Guard(); ran {
		os.Exit(code)
	}
	err := run(os.Args[1:], os.Stdout)
	if err == nil {
		return
	}
	// The agent put a new build of itself in place and stopped: hand the
	// process over to it (same pid, so guests' supervisor never changes).
	var restart *upgrade.Restart
	if errors.As(err, &restart) {
		err = upgrade.Exec(restart)
	}
	fmt.Fprintf(os.Stderr, "eitri: %v\n", err)
	var ue cli.UsageError
	if errors.As(err, &ue) {
		if ue.Cmd != "" {
			fmt.Fprintf(os.Stderr, "Run '%s --help' for usage.\n", ue.Cmd)
		}
		os.Exit(2)
	}
	os.Exit(1)
}

func run(args []string, out io.Writer) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if path := os.Getenv("EITRI_CPUPROFILE"); path != "" {
		// For benchmarks (bench/scale -cpuprofile): the process's whole
		// life, written when it ends on a signal or by itself.
		stopProfile, err := startCPUProfile(path)
		if err != nil {
			return err
		}
		defer stopProfile()
	}
	return execute(ctx, args, cli.IO{In: os.Stdin, Out: out, Err: os.Stderr})
}

// execute runs one command line.
func execute(ctx context.Context, args []string, io cli.IO) error {
	return cli.Execute(ctx, args, io, version, newServerCmd(), newAgentCmd(), newDevCmd())
}

func newLogger(level string) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l}))
}

func startCPUProfile(path string) (func(), error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("EITRI_CPUPROFILE: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("EITRI_CPUPROFILE: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}
