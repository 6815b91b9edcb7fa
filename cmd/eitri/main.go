// Command eitri is the one binary: the control plane (server), the host
// agent (agent), both at once for development (dev), and the client
// commands (vm, host, expose, token).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

const usage = `eitri — a self-hosted VM fleet manager

Usage:
  eitri server   [flags]   run the control plane
  eitri agent    [flags]   run the host agent (enroll once with --join TOKEN)
  eitri dev      [flags]   control plane + local agent in one process (h2c on loopback)
  eitri version

  eitri vm create NAME --image URL --sha256 HEX [--vcpus N --mem-mb N --disk-gb N --host ID --ssh-key FILE|KEY --stopped]
  eitri vm ls | get ID | start ID | stop ID | rm ID | restore ID | retry NAME|ID | events ID | watch
                  (retry: a failed VM is tried again, with a fresh budget)
  eitri vm orphans | adopt HOST_ID VM_ID [--owner USER_ID --name NAME] | destroy-orphan HOST_ID VM_ID
                  (admins: VMs hosts hold but this control plane lost or has older records of)
  eitri host ls | get ID | join-token [--ttl 1h] | decommission ID [--force]
                  (--force: a host gone for good, disconnected 10 min or more; its VMs are marked lost)
  eitri expose create VM_ID GUEST_PORT [--host-port N --udp --local --max N] | ls [VM_ID] | rm ID
  eitri token create NAME [--ttl 720h --user NAME] | ls | revoke ID | sessions | end-session ID
  eitri quota get [--user NAME]
  eitri quota set [--user NAME | --defaults] [--vms N --vcpus N --mem-mb N --disk-gb N --exposures N --streams N]
                  (admins; a value of "default" makes a user's limit follow the default again)

Client commands read EITRI_URL (default http://127.0.0.1:8080) and EITRI_TOKEN.
Add -o json to a client command for the API's JSON.
`

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		var ue usageError
		if errors.As(err, &ue) {
			fmt.Fprintf(os.Stderr, "eitri: %v\n\n%s", err, usage)
			os.Exit(2)
		}
		fmt.Fprintf(os.Stderr, "eitri: %v\n", err)
		os.Exit(1)
	}
}

type usageError struct{ error }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

func run(args []string, out io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(out, usage)
		return nil
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	switch args[0] {
	case "server":
		return cmdServer(ctx, args[1:])
	case "agent":
		return cmdAgent(ctx, args[1:])
	case "dev":
		return cmdDev(ctx, args[1:])
	case "version", "--version", "-v":
		fmt.Fprintln(out, "eitri", version)
		return nil
	case "vm", "host", "expose", "token", "quota":
		return cmdClient(ctx, args[0], args[1:], out)
	case "help", "-h", "--help":
		fmt.Fprint(out, usage)
		return nil
	}
	return usagef("unknown command %q", args[0])
}

func newLogger(level string) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l}))
}

// parse parses flags that may come after positional arguments too
// ("eitri vm get ID -o json").
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, usageError{err}
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, nil
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}
