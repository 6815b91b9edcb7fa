package exposeproxy

import (
	"context"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var loopback = netip.MustParseAddr("127.0.0.1")

// guests is a Resolver whose answers a test can change.
type guests struct {
	mu sync.Mutex
	m  map[string]netip.Addr
}

func newGuests(pairs ...any) *guests {
	g := &guests{m: make(map[string]netip.Addr)}
	for i := 0; i+1 < len(pairs); i += 2 {
		g.m[pairs[i].(string)] = pairs[i+1].(netip.Addr)
	}
	return g
}

func (g *guests) resolve(vm string) (netip.Addr, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	a, ok := g.m[vm]
	return a, ok
}

func (g *guests) set(vm string, a netip.Addr) {
	g.mu.Lock()
	g.m[vm] = a
	g.mu.Unlock()
}

// logs records every slog record so tests can count warnings and debug lines.
type logs struct {
	mu   sync.Mutex
	recs []slog.Record
}

func (h *logs) Enabled(context.Context, slog.Level) bool { return true }
func (h *logs) Handle(_ context.Context, r slog.Record) error {
	h.mu.Lock()
	h.recs = append(h.recs, r.Clone())
	h.mu.Unlock()
	return nil
}
func (h *logs) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h *logs) WithGroup(string) slog.Handler      { return h }

func (h *logs) count(level slog.Level, substr string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, r := range h.recs {
		if r.Level == level && strings.Contains(r.Message, substr) {
			n++
		}
	}
	return n
}

// attr is key's value on the last record at level whose message holds
// substr, and whether there is one.
func (h *logs) attr(level slog.Level, substr, key string) (slog.Value, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i := len(h.recs) - 1; i >= 0; i-- {
		r := h.recs[i]
		if r.Level != level || !strings.Contains(r.Message, substr) {
			continue
		}
		var v slog.Value
		found := false
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == key {
				v, found = a.Value, true
				return false
			}
			return true
		})
		return v, found
	}
	return slog.Value{}, false
}

// clock is a settable time for the proxy's warning spacing, read by its
// serve loops while a test moves it.
type clock struct{ ns atomic.Int64 }

func (c *clock) now() time.Time          { return time.Unix(0, c.ns.Load()) }
func (c *clock) advance(d time.Duration) { c.ns.Add(int64(d)) }

type testProxy struct {
	*Proxy
	logs *logs
}

func newTestProxy(t *testing.T, g *guests, mod func(*Config)) testProxy {
	t.Helper()
	l := &logs{}
	cfg := Config{Log: slog.New(l), Resolve: g.resolve, DialTimeout: 2 * time.Second}
	if mod != nil {
		mod(&cfg)
	}
	p := New(cfg)
	t.Cleanup(p.Close)
	return testProxy{Proxy: p, logs: l}
}

func tcpSpec(id, vm string, guestPort uint16) Spec {
	return Spec{ID: id, VMID: vm, Protocol: TCP, Listen: netip.AddrPortFrom(loopback, 0), GuestPort: guestPort}
}

func udpSpec(id, vm string, guestPort uint16) Spec {
	s := tcpSpec(id, vm, guestPort)
	s.Protocol = UDP
	return s
}

// converge applies specs and requires every exposure to come up.
func (p testProxy) converge(t *testing.T, specs ...Spec) map[string]Status {
	t.Helper()
	out := map[string]Status{}
	for _, st := range p.Converge(specs) {
		require.Equal(t, StateActive, st.State, "exposure %s: %s", st.ID, st.Reason)
		out[st.ID] = st
	}
	return out
}

func (p testProxy) status(t *testing.T, id string) Status {
	t.Helper()
	for _, st := range p.Status() {
		if st.ID == id {
			return st
		}
	}
	t.Fatalf("exposure %q not reported", id)
	return Status{}
}

func (p testProxy) waitActive(t *testing.T, id string, n int64) {
	t.Helper()
	require.Eventually(t, func() bool { return p.status(t, id).Active == n },
		5*time.Second, 5*time.Millisecond, "exposure %s never reached %d active", id, n)
}

func listenTCP(t testing.TB, addr netip.Addr) *net.TCPListener {
	t.Helper()
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(addr, 0)))
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	return ln
}

func tcpPort(ln *net.TCPListener) uint16 { return ln.Addr().(*net.TCPAddr).AddrPort().Port() }

// serveGuest runs handle for every connection to a loopback listener and
// returns its port.
func serveGuest(t testing.TB, handle func(c *net.TCPConn)) uint16 {
	t.Helper()
	ln := listenTCP(t, loopback)
	go func() {
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c)
			}()
		}
	}()
	return tcpPort(ln)
}

// holdingGuest accepts and keeps connections open until the peer closes.
func holdingGuest(t testing.TB) uint16 {
	return serveGuest(t, func(c *net.TCPConn) { io.Copy(io.Discard, c) })
}

func echoGuest(t testing.TB) uint16 {
	return serveGuest(t, func(c *net.TCPConn) {
		io.Copy(c, c)
		c.CloseWrite()
	})
}

func dialTCP(t *testing.T, ap netip.AddrPort) *net.TCPConn {
	t.Helper()
	c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(ap))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	return c
}

// expectClosed requires the proxy to close c without sending anything.
func expectClosed(t *testing.T, c net.Conn) {
	t.Helper()
	got, err := io.ReadAll(c)
	require.NoError(t, err, "expected an orderly close")
	require.Empty(t, got)
}

// closedPort returns a loopback TCP port nothing listens on.
func closedPort(t *testing.T) uint16 {
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(loopback, 0)))
	require.NoError(t, err)
	port := tcpPort(ln)
	ln.Close()
	return port
}

// udpGuest answers each datagram with prefix+payload from addr (port 0 picks
// one); with prefix "" it never answers.
func udpGuest(t testing.TB, ap netip.AddrPort, prefix string) uint16 {
	t.Helper()
	pc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(ap))
	require.NoError(t, err)
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, maxDatagram)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			if prefix != "" {
				pc.WriteToUDPAddrPort(append([]byte(prefix), buf[:n]...), from)
			}
		}
	}()
	return pc.LocalAddr().(*net.UDPAddr).AddrPort().Port()
}

func udpClient(t *testing.T, to netip.AddrPort) *net.UDPConn {
	t.Helper()
	c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// say sends msg and returns the answer.
func say(t *testing.T, c *net.UDPConn, msg string) string {
	t.Helper()
	_, err := c.Write([]byte(msg))
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
	buf := make([]byte, maxDatagram)
	n, err := c.Read(buf)
	require.NoError(t, err)
	return string(buf[:n])
}

// sayUnanswered sends msg and requires that no answer comes back.
func sayUnanswered(t *testing.T, c *net.UDPConn, msg string) {
	t.Helper()
	_, err := c.Write([]byte(msg))
	require.NoError(t, err)
	require.NoError(t, c.SetReadDeadline(time.Now().Add(200*time.Millisecond)))
	_, err = c.Read(make([]byte, 64))
	require.Error(t, err, "a datagram came back that should have gone nowhere")
}
