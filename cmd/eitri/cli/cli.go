// Package cli holds eitri's client commands (login, vm, host, expose,
// token, quota, ssh, tunnel, port-forward, ssh-ca) and the command tree they
// hang from. They speak to a control plane only through the API (gen/) and
// what every side shares (wire/), never the server's or the agent's code, so
// what a user runs sees the fleet exactly as any other API client does.
// The commands that run the fleet (server, agent, dev) are the caller's.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"
)

// IO is what a command line runs with: where it reads and writes, and the
// eitri binary it may run again. Tests give their own.
type IO struct {
	In       io.Reader
	Out, Err io.Writer
	// Self is the eitri binary eitri ssh runs as its ProxyCommand (nil:
	// this one); a test binary, which is not eitri, names a real one.
	Self func() (string, error)
}

// UsageError is a command line that cannot be run as typed (exit status 2),
// as opposed to a command that ran and failed.
type UsageError struct {
	error
	// Cmd is the command whose help explains it, when known.
	Cmd string
}

// Usagef is a UsageError with a formatted message.
func Usagef(format string, args ...any) error {
	return UsageError{error: fmt.Errorf(format, args...)}
}

// Execute runs one command line. run are the commands that run the fleet,
// built fresh for this command line.
func Execute(ctx context.Context, args []string, io IO, version string, run ...*cobra.Command) error {
	root := Root(io, version, run...)
	root.SetArgs(args)
	cmd, err := root.ExecuteContextC(ctx)
	var ue UsageError
	if errors.As(err, &ue) && ue.Cmd == "" && cmd != nil {
		ue.Cmd = cmd.CommandPath()
		return ue
	}
	return err
}

const (
	groupRun    = "run"
	groupClient = "client"
)

// Root builds the command tree: run (server, agent, dev) and the client
// commands. Each command is built fresh, so one process may run several
// command lines (the tests do).
func Root(io IO, version string, run ...*cobra.Command) *cobra.Command {
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
	root.SetIn(io.In)
	root.SetOut(io.Out)
	root.SetErr(io.Err)
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return UsageError{error: err} })
	root.AddGroup(&cobra.Group{ID: groupRun, Title: "Run the fleet:"}, &cobra.Group{ID: groupClient, Title: "Use the fleet:"})

	for _, c := range run {
		c.GroupID = groupRun
		root.AddCommand(c)
	}
	a := &app{io: io, format: formatTable}
	for _, c := range []*cobra.Command{
		newLoginCmd(a), newLogoutCmd(a),
		newVMCmd(a), newImageCmd(a), newHostCmd(a), newExposeCmd(a), newTokenCmd(a), newQuotaCmd(a),
		newSSHCmd(a), newTunnelCmd(a), newPortForwardCmd(a),
		newSSHCACmd(a), newReleaseCmd(a),
	} {
		c.GroupID = groupClient
		root.AddCommand(c)
	}
	root.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Print eitri's version",
		Args:  NoArgs,
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
				return Usagef("%s needs a subcommand", cmd.CommandPath())
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
		return Usagef("unknown command %q for %s; did you mean %q?", arg, cmd.CommandPath(), s[0])
	}
	return Usagef("unknown command %q for %s", arg, cmd.CommandPath())
}

// NoArgs refuses positional arguments, as a usage error.
func NoArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return Usagef("%s takes no arguments, got %q", cmd.CommandPath(), args[0])
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
			return Usagef("%s needs %s", cmd.CommandPath(), names[len(args)])
		case len(args) > len(names):
			return Usagef("%s takes %d argument(s), got %d", cmd.CommandPath(), len(names), len(args))
		}
		return nil
	}
}

// ShellQuote quotes s for a POSIX shell when it needs it: for lines a person
// pastes (the first admin's token, a migration's next steps) and ssh's
// ProxyCommand.
func ShellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-+:@%") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
