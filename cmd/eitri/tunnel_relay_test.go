package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/consolerelay"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/connclient"
)

// loopGuest plays a guest's TCP services on loopback: the agent's real
// relay dials it at 127.0.0.1, the address the test's lookup gives the
// running VMs.
type loopGuest struct {
	mu      sync.Mutex
	running map[string]bool
}

func (g *loopGuest) addr(vmID string) (netip.Addr, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return netip.MustParseAddr("127.0.0.1"), g.running[vmID]
}

func (g *loopGuest) run(vmID string, on bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.running[vmID] = on
}

// serveTCP accepts on a loopback port until the test ends, handing each
// connection to fn.
func serveTCP(t *testing.T, fn func(c *net.TCPConn)) uint32 {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				fn(c.(*net.TCPConn))
			}()
		}
	}()
	return uint32(ln.Addr().(*net.TCPAddr).Port)
}

// echoUntilEOF echoes what it reads; at the caller's half-close it says
// how much it read, and closes.
func echoUntilEOF(c *net.TCPConn) {
	n, _ := io.Copy(c, c)
	fmt.Fprintf(c, "[%d bytes]", n)
}

// tunnelEnv is a control plane with one relaying host and a VM on it.
type tunnelEnv struct {
	*cliEnv
	vms   eitriv1connect.VMServiceClient
	guest *loopGuest
	vmID  string
}

func newTunnelEnv(t *testing.T, cfg server.Config) *tunnelEnv {
	e := newCLIEnv(t, cfg)
	g := &loopGuest{running: map[string]bool{}}
	ident := e.relayHost("h1", &scriptedHost{}, consolerelay.Config{Guests: g.addr})
	vms := eitriv1connect.NewVMServiceClient(connclient.HTTPClient(""), e.url, connect.WithInterceptors(connclient.Bearer(e.srv.AdminToken)))
	r, err := vms.CreateVM(context.Background(), connect.NewRequest(&eitriv1.CreateVMRequest{Name: "web-1", HostId: ident.HostID,
		ImageUrl: "http://images.test/g.raw", ImageSha256: strings.Repeat("ab", 32), Vcpus: 1, MemMb: 256, DiskGb: 1}))
	require.NoError(t, err)
	g.run(r.Msg.Vm.Id, true)
	return &tunnelEnv{cliEnv: e, vms: vms, guest: g, vmID: r.Msg.Vm.Id}
}

type tunnelStream = connect.BidiStreamForClient[eitriv1.OpenTunnelRequest, eitriv1.OpenTunnelResponse]

// openTunnel opens a tunnel and waits for the guest to take it. The stream
// is reset when ctx ends (an HTTP/2 client stream whose request is still
// open does not notice its context otherwise).
func openTunnel(ctx context.Context, vms eitriv1connect.VMServiceClient, first *eitriv1.OpenTunnelRequest) (*tunnelStream, error) {
	st := vms.OpenTunnel(ctx)
	context.AfterFunc(ctx, func() { _ = st.CloseResponse() })
	if err := st.Send(first); err != nil && !errors.Is(err, io.EOF) {
		return nil, err
	}
	if _, err := st.Receive(); err != nil {
		return nil, err
	}
	return st, nil
}

// readTunnel reads a tunnel to its end: the bytes, whether the guest said
// eof, and how the stream ended.
func readTunnel(st *tunnelStream) (string, bool, error) {
	var out bytes.Buffer
	eof := false
	for {
		m, err := st.Receive()
		if errors.Is(err, io.EOF) {
			return out.String(), eof, nil
		}
		if err != nil {
			return out.String(), eof, err
		}
		out.Write(m.GetData())
		eof = eof || m.GetEof()
	}
}

func (e *tunnelEnv) events(t *testing.T, kind string) []string {
	t.Helper()
	r, err := e.vms.ListVMEvents(context.Background(), connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: e.vmID}))
	require.NoError(t, err)
	var out []string
	for _, ev := range r.Msg.Events {
		if ev.Kind == kind {
			out = append(out, ev.Message)
		}
	}
	return out
}

// Tunnels through the API, relayed by the agent's real relay to a loopback
// "guest". It lives here, where the control plane and the agent are
// composed, because server code and its tests import no agent code.
func TestTunnelsAreRelayedByTheVMsHostWithHalfClosesBoundsAndEvents(t *testing.T) {
	e := newTunnelEnv(t, server.Config{MaxTunnelsPerUser: 2})
	// Every stream ends before the server is closed (which waits for them).
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	code := connect.CodeOf
	echo := serveTCP(t, echoUntilEOF)

	t.Run("bytes go both ways and each side's half-close reaches the other", func(t *testing.T) {
		st, err := openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: echo, Data: []byte("hello ")})
		require.NoError(t, err)
		require.NoError(t, st.Send(&eitriv1.OpenTunnelRequest{Data: []byte("guest")}))
		require.NoError(t, st.CloseRequest())
		got, eof, err := readTunnel(st)
		require.NoError(t, err)
		assert.Equal(t, "hello guest[11 bytes]", got, "the guest read our bytes up to our half-close, and its answer came back")
		assert.True(t, eof, "the guest's close arrives as eof")
		require.Eventually(t, func() bool { return len(e.events(t, "tunnel")) == 1 }, 5*time.Second, 10*time.Millisecond)
		ev := e.events(t, "tunnel")[0]
		assert.Contains(t, ev, fmt.Sprintf("tunnel to port %d by admin", echo))
		assert.Contains(t, ev, "11 bytes to the guest, 21 bytes from it")
		assert.Contains(t, ev, "closed by both sides")
	})

	t.Run("the guest may close its side first and still read", func(t *testing.T) {
		port := serveTCP(t, func(c *net.TCPConn) {
			_, _ = io.WriteString(c, "say something")
			_ = c.CloseWrite()
			b, _ := io.ReadAll(c)
			_ = b // read to the caller's half-close, then close
		})
		st, err := openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: port})
		require.NoError(t, err)
		var got bytes.Buffer
		for !strings.HasSuffix(got.String(), "something") {
			m, err := st.Receive()
			require.NoError(t, err)
			got.Write(m.GetData())
		}
		m, err := st.Receive()
		require.NoError(t, err)
		require.True(t, m.GetEof(), "the guest's half-close comes as eof while the stream stays open")
		require.NoError(t, st.Send(&eitriv1.OpenTunnelRequest{Data: []byte("still sending")}), "the caller's side is still open")
		require.NoError(t, st.CloseRequest())
		_, err = st.Receive()
		assert.ErrorIs(t, err, io.EOF, "the stream ends once both sides closed")
	})

	t.Run("bad requests name the field", func(t *testing.T) {
		for _, c := range []struct {
			first *eitriv1.OpenTunnelRequest
			field string
		}{
			{&eitriv1.OpenTunnelRequest{VmId: e.vmID}, "port:"},
			{&eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: 65536}, "port:"},
			{&eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: echo, Data: make([]byte, 32<<10+1)}, "data:"},
			{&eitriv1.OpenTunnelRequest{Port: echo}, "id:"},
		} {
			_, err := openTunnel(ctx, e.vms, c.first)
			assert.Equal(t, connect.CodeInvalidArgument, code(err), "%v", err)
			assert.ErrorContains(t, err, c.field)
		}
		st := e.vms.OpenTunnel(ctx)
		require.NoError(t, st.CloseRequest())
		_, err := st.Receive()
		assert.Equal(t, connect.CodeInvalidArgument, code(err), "%v", err)
		assert.ErrorContains(t, err, "vm_id:", "a stream that names nothing")

		st, err = openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: echo})
		require.NoError(t, err)
		require.NoError(t, st.Send(&eitriv1.OpenTunnelRequest{Data: make([]byte, 64<<10)}))
		_, _, err = readTunnel(st)
		assert.Equal(t, connect.CodeResourceExhausted, code(err), "a message over the bound ends the tunnel: %v", err)
	})

	t.Run("another user's VM is not found and an unauthenticated caller gets nothing", func(t *testing.T) {
		tokens := eitriv1connect.NewTokenServiceClient(connclient.HTTPClient(""), e.url, connect.WithInterceptors(connclient.Bearer(e.srv.AdminToken)))
		tok, err := tokens.CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "t", UserName: "mallory"}))
		require.NoError(t, err)
		other := eitriv1connect.NewVMServiceClient(connclient.HTTPClient(""), e.url, connect.WithInterceptors(connclient.Bearer(tok.Msg.Secret)))
		_, err = openTunnel(ctx, other, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: echo})
		assert.Equal(t, connect.CodeNotFound, code(err), "%v", err)

		anon := eitriv1connect.NewVMServiceClient(connclient.HTTPClient(""), e.url)
		_, err = openTunnel(ctx, anon, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: echo})
		assert.Equal(t, connect.CodeUnauthenticated, code(err), "%v", err)
	})

	t.Run("a port the guest refuses, and a VM that is not running, are failed preconditions", func(t *testing.T) {
		closed := uint32(hostFreePort(t))
		_, err := openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: closed})
		assert.Equal(t, connect.CodeFailedPrecondition, code(err), "%v", err)
		assert.ErrorContains(t, err, fmt.Sprintf("port %d", closed))

		e.guest.run(e.vmID, false)
		defer e.guest.run(e.vmID, true)
		_, err = openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: echo})
		assert.Equal(t, connect.CodeFailedPrecondition, code(err), "%v", err)
		assert.ErrorContains(t, err, "not running")
		require.Eventually(t, func() bool {
			for _, ev := range e.events(t, "tunnel") {
				if strings.Contains(ev, "failed: vm "+e.vmID+" is not running") {
					return true
				}
			}
			return false
		}, 5*time.Second, 10*time.Millisecond, "a refused tunnel is recorded too")
	})

	t.Run("each user holds at most its cap of tunnels at once", func(t *testing.T) {
		hold := serveTCP(t, func(c *net.TCPConn) { _, _ = io.Copy(io.Discard, c) })
		tctx, cancel := context.WithCancel(ctx)
		defer cancel()
		var open []*tunnelStream
		for range 2 {
			st, err := openTunnel(tctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: hold})
			require.NoError(t, err)
			open = append(open, st)
		}
		_, err := openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: hold})
		assert.Equal(t, connect.CodeResourceExhausted, code(err), "%v", err)
		assert.ErrorContains(t, err, "tunnels")
		// They are streams too, in the caller's quota.
		quotas := eitriv1connect.NewQuotaServiceClient(connclient.HTTPClient(""), e.url, connect.WithInterceptors(connclient.Bearer(e.srv.AdminToken)))
		// (Eventually: an earlier stream's slot is given back just after
		// its caller has seen it end.)
		require.Eventually(t, func() bool {
			q, err := quotas.GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{}))
			return err == nil && q.Msg.GetQuota().GetUsage().GetStreams() == 2
		}, 5*time.Second, 10*time.Millisecond, "the open tunnels count as streams")

		require.NoError(t, open[0].CloseRequest())
		_, _, _ = readTunnel(open[0])
		require.Eventually(t, func() bool {
			st, err := openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: echo})
			if err != nil {
				return false
			}
			_ = st.CloseRequest()
			_, _, err = readTunnel(st)
			return err == nil
		}, 5*time.Second, 20*time.Millisecond, "a closed tunnel gives its place back")
	})

	t.Run("a caller that stops reading stops the guest's writes", func(t *testing.T) {
		// More than every buffer on the way can hold: the kernel's socket
		// buffers on loopback alone may grow to tens of MiB.
		const total = 512 << 20
		var written atomic.Int64
		port := serveTCP(t, func(c *net.TCPConn) {
			// Random: tunnels do not compress, but if they did, zeros
			// would pass a window's worth of bytes many times over.
			chunk := make([]byte, 64<<10)
			_, _ = rand.Read(chunk)
			for written.Load() < total {
				n, err := c.Write(chunk)
				written.Add(int64(n))
				if err != nil {
					return
				}
			}
		})
		st, err := openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: port})
		require.NoError(t, err)
		// Not reading: the guest writes until every window on the way is
		// full, and then no more.
		var last int64 = -1
		require.Eventually(t, func() bool {
			n := written.Load()
			stalled := n > 0 && n == last
			last = n
			return stalled
		}, 30*time.Second, 500*time.Millisecond, "the guest's writes stall")
		held := written.Load()
		assert.Less(t, held, int64(total/4), "what is held on the way is bounded by flow-control windows and socket buffers")
		t.Logf("held on the way while the caller did not read: %d KiB", held>>10)

		var got int64
		for got < held+1<<20 {
			m, err := st.Receive()
			require.NoError(t, err)
			got += int64(len(m.GetData()))
		}
		assert.Greater(t, written.Load(), held, "reading again, the guest writes again")
	})

	t.Run("a host cannot answer a tunnel call it was not sent", func(t *testing.T) {
		ident := e.enroll("h2")
		ac := eitriv1connect.NewAgentServiceClient(connclient.HTTPClient(""), e.url, connect.WithInterceptors(connclient.Bearer(ident.Credential)))
		c := ac.Tunnel(ctx)
		require.NoError(t, c.Send(&eitriv1.TunnelRequest{CallId: "call-made-up"}))
		_, err := c.Receive()
		_ = c.CloseRequest()
		assert.Equal(t, connect.CodeNotFound, code(err), "%v", err)
	})
}

// hostFreePort is a loopback TCP port nothing listens on.
func hostFreePort(t *testing.T) int {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return p
}

// The CLI's tunnel commands against the same loopback guest.
func TestEitriTunnelAndPortForwardCarryAConnection(t *testing.T) {
	e := newTunnelEnv(t, server.Config{})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hostname=web-1 path=%s\n", r.URL.Path)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	httpPort := ln.Addr().(*net.TCPAddr).Port

	t.Run("eitri tunnel", func(t *testing.T) {
		var out, errOut outputtest.Buffer
		err := execute(context.Background(), []string{"tunnel", "web-1", strconv.Itoa(httpPort)},
			cli.IO{In: strings.NewReader("GET /via-tunnel HTTP/1.0\r\n\r\n"), Out: &out, Err: &errOut})
		require.NoError(t, err, errOut.String())
		assert.Contains(t, out.String(), "HTTP/1.0 200 OK")
		assert.Contains(t, out.String(), "hostname=web-1 path=/via-tunnel")
	})

	t.Run("eitri port-forward", func(t *testing.T) {
		local := hostFreePort(t)
		ctx, stop := context.WithCancel(context.Background())
		var errOut outputtest.Buffer
		done := make(chan error, 1)
		go func() {
			done <- execute(ctx, []string{"port-forward", "web-1", fmt.Sprintf("%d:%d", local, httpPort)},
				cli.IO{In: strings.NewReader(""), Out: io.Discard, Err: &errOut})
		}()
		url := fmt.Sprintf("http://127.0.0.1:%d/via-forward", local)
		var body string
		require.Eventually(t, func() bool {
			resp, err := http.Get(url)
			if err != nil {
				return false
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			body = string(b)
			return true
		}, 10*time.Second, 20*time.Millisecond, "the forward listens")
		assert.Equal(t, "hostname=web-1 path=/via-forward\n", body)
		for i := range 3 {
			resp, err := http.Get(url + strconv.Itoa(i))
			require.NoError(t, err, "each connection gets its own tunnel")
			resp.Body.Close()
		}
		assert.Contains(t, errOut.String(), fmt.Sprintf("Forwarding 127.0.0.1:%d to port %d of web-1", local, httpPort))
		stop()
		require.NoError(t, <-done, "an interrupted forward ends cleanly")
	})

	t.Run("bad ports are usage errors", func(t *testing.T) {
		for _, args := range [][]string{{"tunnel", "web-1", "0"}, {"tunnel", "web-1", "x"}, {"port-forward", "web-1", "80"}, {"port-forward", "web-1", "8080:70000"}} {
			_, err := e.eitri(args...)
			var ue cli.UsageError
			assert.ErrorAs(t, err, &ue, "%v: %v", args, err)
		}
	})
}
