package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"text/tabwriter"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"golang.org/x/term"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// app is what the client commands share: the process's stdio and the
// output format of the command line being run.
type app struct {
	io     IO
	format outputFormat
}

// outputFormat is -o: a table for people, or the API's own JSON (or the
// same as YAML) for programs.
type outputFormat string

const (
	formatTable outputFormat = "table"
	formatJSON  outputFormat = "json"
	formatYAML  outputFormat = "yaml"
)

var formats = []string{string(formatTable), string(formatJSON), string(formatYAML)}

func (f *outputFormat) String() string {
	if *f == "" {
		return string(formatTable)
	}
	return string(*f)
}

func (f *outputFormat) Set(s string) error {
	switch outputFormat(s) {
	case formatTable, formatJSON, formatYAML:
		*f = outputFormat(s)
		return nil
	}
	return fmt.Errorf("want one of %s, got %q", strings.Join(formats, ", "), s)
}

func (f *outputFormat) Type() string { return "format" }

// addOutputFlag gives cmd and everything under it -o.
func (a *app) addOutputFlag(cmd *cobra.Command) {
	cmd.PersistentFlags().VarP(&a.format, "output", "o", "output: "+strings.Join(formats, ", "))
	_ = cmd.RegisterFlagCompletionFunc("output", cobra.FixedCompletions(formats, cobra.ShellCompDirectiveNoFileComp))
}

// client is the generated API clients for the control plane the command
// line is pointed at, and how to show what they return.
type client struct {
	vm      eitriv1connect.VMServiceClient
	host    eitriv1connect.HostServiceClient
	exp     eitriv1connect.ExposureServiceClient
	token   eitriv1connect.TokenServiceClient
	quota   eitriv1connect.QuotaServiceClient
	ssh     eitriv1connect.SSHServiceClient
	release eitriv1connect.ReleaseServiceClient
	image   eitriv1connect.ImageServiceClient
	usage   eitriv1connect.UsageServiceClient
	out     io.Writer
	// errOut is for what a person reads beside machine output (the
	// narration of a wait under -o json).
	errOut io.Writer
	format outputFormat
	// tty: out is a terminal, so progress may be drawn in place.
	tty bool
	// self is this eitri binary, which ssh runs as its ProxyCommand.
	self func() (string, error)
}

// dial makes a client for the control plane the saved login and the
// environment name.
func (a *app) dial() (*client, error) {
	ep, err := resolveEndpoint()
	if err != nil {
		return nil, err
	}
	return a.clientFor(ep), nil
}

func (a *app) clientFor(ep endpoint) *client {
	hc := httpClient(ep)
	opt := connect.WithInterceptors(connclient.Bearer(ep.Token))
	self := a.io.Self
	if self == nil {
		self = os.Executable
	}
	return &client{
		vm:      eitriv1connect.NewVMServiceClient(hc, ep.URL, opt),
		host:    eitriv1connect.NewHostServiceClient(hc, ep.URL, opt),
		exp:     eitriv1connect.NewExposureServiceClient(hc, ep.URL, opt),
		token:   eitriv1connect.NewTokenServiceClient(hc, ep.URL, opt),
		quota:   eitriv1connect.NewQuotaServiceClient(hc, ep.URL, opt),
		ssh:     eitriv1connect.NewSSHServiceClient(hc, ep.URL, opt),
		release: eitriv1connect.NewReleaseServiceClient(hc, ep.URL, opt),
		image:   eitriv1connect.NewImageServiceClient(hc, ep.URL, opt),
		usage:   eitriv1connect.NewUsageServiceClient(hc, ep.URL, opt),
		out:     a.io.Out,
		errOut:  a.io.Err,
		format:  a.format,
		tty:     isTerminal(a.io.Out),
		self:    self,
	}
}

// httpClient speaks HTTP/2 to the control plane: h2c for http:// (dev
// mode on loopback), TLS pinned to the saved fingerprint, or TLS checked
// against the system's CAs when nothing is pinned.
func httpClient(ep endpoint) *http.Client {
	if len(ep.urls()) > 1 {
		// Several replicas: each new connection goes to one that answers.
		if hc, _, err := connclient.Replicas(ep.Fingerprint, ep.urls()); err == nil {
			return hc
		}
	}
	switch {
	case strings.HasPrefix(ep.URL, "http://"):
		return connclient.HTTPClient("")
	case ep.Fingerprint != "":
		return connclient.HTTPClient(ep.Fingerprint)
	}
	return http.DefaultClient
}

func isTerminal(w any) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// jsonOut is the API's JSON: snake_case names, every field, as the
// Connect JSON protocol speaks it.
var jsonOut = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}

// show prints m as -o asks: the table, or the message as JSON or YAML.
func (c *client) show(m proto.Message, table func(w io.Writer)) error {
	switch c.format {
	case formatJSON, formatYAML:
		b, err := encode(m, c.format, true)
		if err != nil {
			return err
		}
		_, err = c.out.Write(b)
		return err
	}
	tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
	table(tw)
	return tw.Flush()
}

// encode renders m as JSON (indented when multiline, else one line) or
// YAML, ending in a newline.
func encode(m proto.Message, f outputFormat, multiline bool) ([]byte, error) {
	o := jsonOut
	o.Multiline = multiline
	b, err := o.Marshal(m)
	if err != nil {
		return nil, err
	}
	if f == formatYAML {
		return yamlFromJSON(b)
	}
	return append(b, '\n'), nil
}

// apiError words a Connect error for a terminal: the code, then the
// server's message (which names the field at fault).
func apiError(err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return fmt.Errorf("%s: %s", strings.ReplaceAll(ce.Code().String(), "_", " "), ce.Message())
	}
	return err
}

// flagGiven says whether the command line set the flag.
func flagGiven(fs *pflag.FlagSet, name string) bool {
	f := fs.Lookup(name)
	return f != nil && f.Changed
}

// withClient is the RunE of a command that talks to the control plane: it
// dials it, then runs fn.
func (a *app) withClient(fn func(ctx context.Context, c *client) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, _ []string) error {
		c, err := a.dial()
		if err != nil {
			return err
		}
		return fn(cmd.Context(), c)
	}
}

// withClientArgs is withClient for a command that reads its arguments.
func (a *app) withClientArgs(fn func(ctx context.Context, c *client, args []string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		c, err := a.dial()
		if err != nil {
			return err
		}
		return fn(cmd.Context(), c, args)
	}
}

// onVM is the RunE of a command on one VM, named or by id in its first
// argument: it dials the control plane and resolves the VM, then runs fn.
func (a *app) onVM(fn func(ctx context.Context, c *client, id string) error) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		c, err := a.dial()
		if err != nil {
			return err
		}
		id, err := c.vmID(cmd.Context(), args[0])
		if err != nil {
			return err
		}
		return fn(cmd.Context(), c, id)
	}
}
