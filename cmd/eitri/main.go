// Command eitri is the one binary: the control plane (server), the host
// agent (agent), both at once for development (dev), and the client
// commands (login, vm, host, expose, token, quota, ssh, tunnel,
// port-forward).
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
)

// version is set at build time (-ldflags "-X main.version=...").
var version = "dev"

func main() {
	err := run(os.Args[1:], os.Stdout)
	if err == nil {
		return
	}
	fmt.Fprintf(os.Stderr, "eitri: %v\n", err)
	var ue usageError
	if errors.As(err, &ue) {
		if ue.cmd != "" {
			fmt.Fprintf(os.Stderr, "Run '%s --help' for usage.\n", ue.cmd)
		}
		os.Exit(2)
	}
	os.Exit(1)
}

// usageError is a command line that cannot be run as typed (exit status 2),
// as opposed to a command that ran and failed.
type usageError struct {
	error
	cmd string // the command whose help explains it, when known
}

func usagef(format string, args ...any) error { return usageError{error: fmt.Errorf(format, args...)} }

// stdio is where a command reads and writes; tests give their own.
type stdio struct {
	in       io.Reader
	out, err io.Writer
}

func run(args []string, out io.Writer) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return execute(ctx, args, stdio{in: os.Stdin, out: out, err: os.Stderr})
}

// execute runs one command line.
func execute(ctx context.Context, args []string, io stdio) error {
	root := newRoot(io)
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	var ue usageError
	if errors.As(err, &ue) && ue.cmd == "" && cmd != nil {
		ue.cmd = cmd.CommandPath()
		return ue
	}
	return err
}

const (
	groupRun    = "run"
	groupClient = "client"
)

// newRoot builds the command tree. Each command is built fresh, so one
// process may run several command lines (the tests do).
func newRoot(io stdio) *cobra.Command {
	root := &cobra.Command{
		Use:   "eitri",
		Short: "eitri — a self-hosted VM fleet manager",
		Long: `eitri — a self-hosted VM fleet manager

Client commands use the control plane saved by 'eitri login' (default
http://127.0.0.1:8080). EITRI_URL, EITRI_TOKEN and EITRI_FINGERPRINT
override it. Add -o json or -o yaml for the API's own field names.`,
		Version:       version,
		SilenceErrors: true,
		SilenceUsage:  true,
		// No arguments prints help; anything else is an unknown command.
		Args: cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return cmd.Help()
			}
			return unknownCommand(cmd, args[0])
		},
	}
	root.SetIn(io.in)
	root.SetOut(io.out)
	root.SetErr(io.err)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{error: err} })
	root.AddGroup(&cobra.Group{ID: groupRun, Title: "Run the fleet:"}, &cobra.Group{ID: groupClient, Title: "Use the fleet:"})

	a := &app{io: io, format: formatTable}
	for _, c := range []*cobra.Command{newServerCmd(), newAgentCmd(), newDevCmd()} {
		c.GroupID = groupRun
		root.AddCommand(c)
	}
	for _, c := range []*cobra.Command{
		newLoginCmd(a), newLogoutCmd(a),
		newVMCmd(a), newHostCmd(a), newExposeCmd(a), newTokenCmd(a), newQuotaCmd(a),
		newSSHCmd(a), newTunnelCmd(a), newPortForwardCmd(a),
		newSSHCACmd(a),
	} {
		c.GroupID = groupClient
		root.AddCommand(c)
	}
	root.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Print eitri's version",
		Args:  noArgs,
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), "eitri version", version) },
	})
	return root
}

// noun is a command that only groups others (eitri vm, eitri host): run
// alone or with a verb it does not know, it is a usage error.
func noun(use, short string, verbs ...*cobra.Command) *cobra.Command {
	c := &cobra.Command{
		Use:   use,
		Short: short,
		Args:  cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return usagef("%s needs a subcommand", cmd.CommandPath())
			}
			return unknownCommand(cmd, args[0])
		},
	}
	c.AddCommand(verbs...)
	return c
}

func unknownCommand(cmd *cobra.Command, arg string) error {
	cmd.SuggestionsMinimumDistance = 2
	if s := cmd.SuggestionsFor(arg); len(s) > 0 {
		return usagef("unknown command %q for %s; did you mean %q?", arg, cmd.CommandPath(), s[0])
	}
	return usagef("unknown command %q for %s", arg, cmd.CommandPath())
}

// noArgs refuses positional arguments, as a usage error.
func noArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usagef("%s takes no arguments, got %q", cmd.CommandPath(), args[0])
	}
	return nil
}

// needArgs wants exactly the named positional arguments.
func needArgs(names ...string) cobra.PositionalArgs {
	return optionalArgs(len(names), names...)
}

// optionalArgs wants the first min of names, and at most all of them.
func optionalArgs(min int, names ...string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		switch {
		case len(args) < min:
			return usagef("%s needs %s", cmd.CommandPath(), names[len(args)])
		case len(args) > len(names):
			return usagef("%s takes %d argument(s), got %d", cmd.CommandPath(), len(names), len(args))
		}
		return nil
	}
}

func newLogger(level string) *slog.Logger {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		l = slog.LevelInfo
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: l}))
}
