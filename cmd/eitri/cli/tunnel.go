package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// tunnelChunk is the API's bound on one tunnel message's data.
const tunnelChunk = 32 << 10

func newTunnelCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "tunnel NAME|ID PORT",
		Short: "Connect stdin and stdout to a TCP port of a VM's guest (for ssh's ProxyCommand)",
		Long: "Opens one TCP connection to PORT on the VM's guest, through the control plane and the VM's host\n" +
			"(nothing is published), and carries stdin to it and what it sends to stdout. The end of stdin\n" +
			"half-closes the connection; the command ends when both sides have closed.",
		Args:              needArgs("a VM name or id", "a guest port"),
		ValidArgsFunction: a.completeVMs,
		RunE: func(cmd *cobra.Command, args []string) error {
			port, err := parsePort("PORT", args[1])
			if err != nil {
				return err
			}
			return a.onVM(func(ctx context.Context, c *client, id string) error {
				return c.tunnel(ctx, id, port, a.io.In, a.io.Out, func() {
					if f, ok := a.io.Out.(*os.File); ok {
						_ = f.Close() // the guest said eof: so does stdout
					}
				}, nil)
			})(cmd, args)
		},
	}
}

func newPortForwardCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "port-forward NAME|ID LOCAL:GUEST",
		Short: "Forward a loopback port to a TCP port of a VM's guest",
		Long: "Listens on 127.0.0.1:LOCAL (0 picks a free port) and carries each connection to GUEST on the\n" +
			"VM's guest, one tunnel each, through the control plane and the VM's host. Runs until interrupted.",
		Args:              needArgs("a VM name or id", "LOCAL:GUEST (a loopback port and a guest port)"),
		ValidArgsFunction: a.completeVMs,
		RunE: func(cmd *cobra.Command, args []string) error {
			local, guest, ok := strings.Cut(args[1], ":")
			if !ok {
				return Usagef("want LOCAL:GUEST (e.g. 8080:80), got %q", args[1])
			}
			lport, err := parsePortOrZero("LOCAL", local)
			if err != nil {
				return err
			}
			gport, err := parsePort("GUEST", guest)
			if err != nil {
				return err
			}
			return a.onVM(func(ctx context.Context, c *client, id string) error {
				ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(lport))))
				if err != nil {
					return err
				}
				fmt.Fprintf(c.errOut, "Forwarding %s to port %d of %s; Ctrl-C stops.\n", ln.Addr(), gport, args[0])
				return c.portForward(ctx, ln, id, gport)
			})(cmd, args)
		},
	}
}

func parsePort(name, s string) (uint32, error) {
	p, err := parsePortOrZero(name, s)
	if err == nil && p == 0 {
		err = Usagef("%s: want a port from 1 to 65535, got %q", name, s)
	}
	return p, err
}

func parsePortOrZero(name, s string) (uint32, error) {
	p, err := strconv.ParseUint(s, 10, 16)
	if err != nil {
		return 0, Usagef("%s: want a port from 1 to 65535, got %q", name, s)
	}
	return uint32(p), nil
}

// portForward carries each connection ln accepts to the guest's port,
// until ctx ends.
func (c *client) portForward(ctx context.Context, ln net.Listener, id string, port uint32) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() {
		<-ctx.Done()
		ln.Close()
	}()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		conn, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer conn.Close()
			closeWrite := func() {
				if cw, ok := conn.(interface{ CloseWrite() error }); ok {
					_ = cw.CloseWrite()
				}
			}
			if err := c.tunnel(ctx, id, port, conn, conn, closeWrite, func() { conn.Close() }); err != nil && ctx.Err() == nil {
				fmt.Fprintf(c.errOut, "eitri: port-forward: %s: %v\n", conn.RemoteAddr(), err)
			}
		}()
	}
}

// tunnel carries one connection to the guest's port: in to it, what it
// sends to out. closeOut is called when the guest half-closes; abortIn
// (may be nil) unblocks a read from in once the tunnel has ended. It
// returns when both sides have closed, or either fails.
func (c *client) tunnel(ctx context.Context, id string, port uint32, in io.Reader, out io.Writer, closeOut, abortIn func()) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st := c.vm.OpenTunnel(ctx)
	// Reset the stream when ctx ends, here or above: an HTTP/2 client
	// stream whose request side is open does not notice its context (its
	// request body is being read), so a Receive would wait for the guest.
	context.AfterFunc(ctx, func() { _ = st.CloseResponse() })
	if err := st.Send(&eitriv1.OpenTunnelRequest{VmId: id, Port: port}); err != nil && !errors.Is(err, io.EOF) {
		return apiError(err)
	}
	if _, err := st.Receive(); err != nil {
		return apiError(err)
	}
	// Only this goroutine sends from here on.
	go func() {
		if err := sendAll(st, in); err != nil {
			cancel() // the local side failed: so does the tunnel
		}
	}()
	defer func() {
		if abortIn != nil {
			abortIn()
		}
	}()
	for {
		m, err := st.Receive()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return apiError(err)
		}
		if len(m.GetData()) > 0 {
			if _, err := out.Write(m.GetData()); err != nil {
				return err
			}
		}
		if m.GetEof() {
			closeOut()
		}
	}
}

// sendAll sends in's bytes on the tunnel, then half-closes it.
func sendAll(st *connect.BidiStreamForClient[eitriv1.OpenTunnelRequest, eitriv1.OpenTunnelResponse], in io.Reader) error {
	buf := make([]byte, tunnelChunk)
	for {
		n, err := in.Read(buf)
		if n > 0 {
			if serr := st.Send(&eitriv1.OpenTunnelRequest{Data: buf[:n]}); serr != nil {
				return serr
			}
		}
		if errors.Is(err, io.EOF) {
			return st.CloseRequest()
		}
		if err != nil {
			return err
		}
	}
}
