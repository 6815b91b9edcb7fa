package exposeproxy

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestTCPCarriesBothWays pins the pipe: bulk data in both directions, a guest
// that speaks first, and a request ended by half-close that still gets its
// answer. Each counts exactly the bytes that crossed it each way.
func TestTCPCarriesBothWays(t *testing.T) {
	payload := make([]byte, 4<<20)
	_, _ = rand.Read(payload)

	cases := []struct {
		name    string
		guest   func(c *net.TCPConn)
		client  func(t *testing.T, c *net.TCPConn)
		in, out int
	}{
		{
			name: "bulk echo",
			guest: func(c *net.TCPConn) {
				io.Copy(c, c)
				c.CloseWrite()
			},
			client: func(t *testing.T, c *net.TCPConn) {
				go func() {
					c.Write(payload)
					c.CloseWrite()
				}()
				got, err := io.ReadAll(c)
				require.NoError(t, err)
				require.True(t, bytes.Equal(payload, got), "echo differs: sent %d bytes, got %d", len(payload), len(got))
			},
			in: len(payload), out: len(payload),
		},
		{
			name: "guest speaks first",
			guest: func(c *net.TCPConn) {
				c.Write([]byte("SSH-2.0-guest\r\n"))
				io.Copy(io.Discard, c)
			},
			client: func(t *testing.T, c *net.TCPConn) {
				buf := make([]byte, 15)
				_, err := io.ReadFull(c, buf)
				require.NoError(t, err)
				assert.Equal(t, "SSH-2.0-guest\r\n", string(buf))
			},
			in: 0, out: 15,
		},
		{
			name: "half-close request gets its answer",
			guest: func(c *net.TCPConn) {
				n, _ := io.Copy(io.Discard, c) // until the client's FIN
				c.Write([]byte(strconv.FormatInt(n, 10)))
			},
			client: func(t *testing.T, c *net.TCPConn) {
				_, err := c.Write(payload)
				require.NoError(t, err)
				require.NoError(t, c.CloseWrite())
				got, err := io.ReadAll(c)
				require.NoError(t, err)
				assert.Equal(t, strconv.Itoa(len(payload)), string(got))
			},
			in: len(payload), out: len(strconv.Itoa(len(payload))),
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			port := serveGuest(t, tc.guest)
			p := newTestProxy(t, newGuests("vm1", loopback), nil)
			st := p.converge(t, tcpSpec("e1", "vm1", port))["e1"]
			c := dialTCP(t, st.Bound)
			tc.client(t, c)
			c.Close()
			p.waitActive(t, "e1", 0)
			got := p.status(t, "e1")
			assert.Zero(t, got.Refused)
			assert.Zero(t, got.Dropped)
			// The pipe counts before it lets go of the connection, so once
			// it is no longer active the totals are final.
			assert.Equal(t, int64(tc.in), got.BytesIn, "caller to guest")
			assert.Equal(t, int64(tc.out), got.BytesOut, "guest to caller")
			assert.Equal(t, 1, p.logs.count(slog.LevelDebug, "connection opened"))
			assert.Equal(t, 1, p.logs.count(slog.LevelDebug, "connection closed"))
		})
	}
}

// TestTCPCapRefusesAndWarnsOncePerStreak: callers past the cap are accepted
// and closed, each counted, and a saturated port warns once per streak rather
// than once per caller, and at most once per warnEvery however often callers
// end a streak by closing a connection.
func TestTCPCapRefusesAndWarnsOncePerStreak(t *testing.T) {
	port := holdingGuest(t)
	p := newTestProxy(t, newGuests("vm1", loopback), func(c *Config) { c.MaxConns = 1 })
	clk := &clock{}
	p.now = clk.now
	bound := p.converge(t, tcpSpec("e1", "vm1", port))["e1"].Bound

	held := dialTCP(t, bound)
	p.waitActive(t, "e1", 1)
	for range 3 {
		expectClosed(t, dialTCP(t, bound))
	}
	got := p.status(t, "e1")
	assert.Equal(t, int64(1), got.Active, "refusals did not disturb the connection under the cap")
	assert.Equal(t, int64(3), got.Refused)
	assert.Zero(t, got.Dropped)
	assert.Equal(t, 1, p.logs.count(slog.LevelWarn, "connection cap"), "one warning for the streak")
	assert.Equal(t, 3, p.logs.count(slog.LevelDebug, "refused a connection"), "a debug line per refusal")

	// The streak ends when a caller gets through; the next saturation warns
	// again once warnEvery has passed.
	saturateAgain := func() {
		t.Helper()
		held.Close()
		p.waitActive(t, "e1", 0)
		held = dialTCP(t, bound)
		p.waitActive(t, "e1", 1)
		expectClosed(t, dialTCP(t, bound))
	}
	clk.advance(warnEvery)
	saturateAgain()
	got = p.status(t, "e1")
	assert.Equal(t, int64(4), got.Refused, "refusals are a running total")
	assert.Equal(t, 2, p.logs.count(slog.LevelWarn, "connection cap"))

	// Streaks inside warnEvery are counted, not logged, and the next warning
	// says how many there were.
	saturateAgain()
	saturateAgain()
	assert.Equal(t, int64(6), p.status(t, "e1").Refused)
	assert.Equal(t, 2, p.logs.count(slog.LevelWarn, "connection cap"), "a caller cannot force a warning per close")
	clk.advance(warnEvery)
	saturateAgain()
	assert.Equal(t, 3, p.logs.count(slog.LevelWarn, "connection cap"))
	v, ok := p.logs.attr(slog.LevelWarn, "connection cap", "unlogged_streaks")
	require.True(t, ok)
	assert.Equal(t, int64(2), v.Int64())
}

// TestTCPSpecCapOverridesDefault: a per-exposure cap beats the proxy default.
func TestTCPSpecCapOverridesDefault(t *testing.T) {
	port := holdingGuest(t)
	p := newTestProxy(t, newGuests("vm1", loopback), func(c *Config) { c.MaxConns = 1 })
	s := tcpSpec("e1", "vm1", port)
	s.MaxSessions = 2
	bound := p.converge(t, s)["e1"].Bound
	dialTCP(t, bound)
	dialTCP(t, bound)
	p.waitActive(t, "e1", 2)
	expectClosed(t, dialTCP(t, bound))
	assert.Equal(t, int64(1), p.status(t, "e1").Refused)
}

// TestTCPDropsWhatItCannotCarry: "dropped" means the guest was not reachable,
// which an operator must be able to tell from the port's own cap.
func TestTCPDropsWhatItCannotCarry(t *testing.T) {
	cases := []struct {
		name  string
		g     *guests
		port  func(t *testing.T) uint16
		debug string
	}{
		{"no guest address", newGuests(), func(*testing.T) uint16 { return 8080 }, "no address"},
		{"guest refuses the dial", newGuests("vm1", loopback), closedPort, "dial failed"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newTestProxy(t, tc.g, nil)
			bound := p.converge(t, tcpSpec("e1", "vm1", tc.port(t)))["e1"].Bound
			expectClosed(t, dialTCP(t, bound))
			p.waitActive(t, "e1", 0)
			require.Eventually(t, func() bool { return p.status(t, "e1").Dropped == 1 }, 5*time.Second, 5*time.Millisecond)
			assert.Zero(t, p.status(t, "e1").Refused, "the cap refused nobody")
			assert.Equal(t, 1, p.logs.count(slog.LevelDebug, tc.debug))
		})
	}
}

// TestRebindKeepsCounters: moving an exposure to a new host port is the same
// exposure; its totals carry over and the old port is released.
func TestRebindKeepsCounters(t *testing.T) {
	p := newTestProxy(t, newGuests(), nil) // no address: every caller is a drop
	s := tcpSpec("e1", "vm1", 8080)
	old := p.converge(t, s)["e1"].Bound
	expectClosed(t, dialTCP(t, old))
	require.Eventually(t, func() bool { return p.status(t, "e1").Dropped == 1 }, 5*time.Second, 5*time.Millisecond)

	moved := listenTCP(t, loopback) // reserve a free port, then hand it over
	s.Listen = moved.Addr().(*net.TCPAddr).AddrPort()
	moved.Close()
	st := p.converge(t, s)["e1"]
	require.Equal(t, s.Listen, st.Bound)
	assert.Equal(t, int64(1), st.Dropped, "the move kept the total")

	_, err := net.DialTimeout("tcp", old.String(), time.Second)
	require.Error(t, err, "the old port is released")
	expectClosed(t, dialTCP(t, st.Bound))
	require.Eventually(t, func() bool { return p.status(t, "e1").Dropped == 2 }, 5*time.Second, 5*time.Millisecond)
}

// TestConvergeClosesRemoved: an exposure absent from the desired list loses
// its port and its connections; the others are untouched.
func TestConvergeClosesRemoved(t *testing.T) {
	port := echoGuest(t)
	p := newTestProxy(t, newGuests("vm1", loopback), nil)
	keep, gone := tcpSpec("keep", "vm1", port), tcpSpec("gone", "vm1", port)
	st := p.converge(t, keep, gone)

	open := dialTCP(t, st["gone"].Bound)
	p.waitActive(t, "gone", 1)
	out := p.Converge([]Spec{keep})
	require.Len(t, out, 1)
	assert.Equal(t, "keep", out[0].ID)
	assert.Equal(t, st["keep"].Bound, out[0].Bound, "a kept exposure is not rebound")

	_, err := net.DialTimeout("tcp", st["gone"].Bound.String(), time.Second)
	assert.Error(t, err, "removed port still listening")
	_, err = io.ReadAll(open)
	assert.NoError(t, err, "the open connection was ended") // EOF or reset both end ReadAll
	for _, s := range p.Status() {
		assert.NotEqual(t, "gone", s.ID)
	}

	c := dialTCP(t, st["keep"].Bound)
	_, err = c.Write([]byte("still here"))
	require.NoError(t, err)
	buf := make([]byte, 10)
	_, err = io.ReadFull(c, buf)
	require.NoError(t, err)
	assert.Equal(t, "still here", string(buf))
}

// TestBindFailureReportsReason: a port already taken is reported failed with
// the OS's words and zero counters, and retried on the next Converge.
func TestBindFailureReportsReason(t *testing.T) {
	for _, proto := range []Protocol{TCP, UDP} {
		t.Run(string(proto), func(t *testing.T) {
			var (
				taken netip.AddrPort
				free  func()
			)
			if proto == TCP {
				ln := listenTCP(t, loopback)
				taken, free = ln.Addr().(*net.TCPAddr).AddrPort(), func() { ln.Close() }
			} else {
				pc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(loopback, 0)))
				require.NoError(t, err)
				taken, free = pc.LocalAddr().(*net.UDPAddr).AddrPort(), func() { pc.Close() }
			}
			p := newTestProxy(t, newGuests("vm1", loopback), nil)
			s := Spec{ID: "e1", VMID: "vm1", Protocol: proto, Listen: taken, GuestPort: 80}

			out := p.Converge([]Spec{s})
			require.Len(t, out, 1)
			assert.Equal(t, StateFailed, out[0].State)
			assert.Contains(t, out[0].Reason, "address already in use")
			assert.Zero(t, out[0].Active)
			assert.Zero(t, out[0].Refused)
			assert.Zero(t, out[0].Dropped)
			assert.False(t, out[0].Bound.IsValid())
			assert.Equal(t, out[0], p.status(t, "e1"), "Status agrees with Converge")

			p.Converge([]Spec{s})
			assert.Equal(t, 1, p.logs.count(slog.LevelWarn, "bind failed"), "the same failure warns once")

			free()
			st := p.converge(t, s)["e1"]
			assert.Equal(t, taken, st.Bound, "retried and bound once the port was free")
			assert.Empty(t, st.Reason)
		})
	}
}

// TestInvalidSpecsFail: a spec that cannot be served reports why instead of
// disappearing from the report.
func TestInvalidSpecsFail(t *testing.T) {
	p := newTestProxy(t, newGuests(), nil)
	good := tcpSpec("ok", "vm1", 80)
	badProto := tcpSpec("proto", "vm1", 80)
	badProto.Protocol = "sctp"
	noPort := tcpSpec("noport", "vm1", 0)
	noAddr := tcpSpec("noaddr", "vm1", 80)
	noAddr.Listen = netip.AddrPort{}
	out := p.Converge([]Spec{good, badProto, noPort, noAddr})
	require.Len(t, out, 4)
	assert.Equal(t, StateActive, out[0].State)
	for _, st := range out[1:] {
		assert.Equal(t, StateFailed, st.State, st.ID)
		assert.NotEmpty(t, st.Reason, st.ID)
	}
}

// TestCountersResetWithANewProxy: totals are for the life of the exposure on
// this agent; a restarted agent starts from zero on the same port.
func TestCountersResetWithANewProxy(t *testing.T) {
	g := newGuests()
	first := newTestProxy(t, g, nil)
	s := tcpSpec("e1", "vm1", 8080)
	s.Listen = first.converge(t, s)["e1"].Bound
	expectClosed(t, dialTCP(t, s.Listen))
	require.Eventually(t, func() bool { return first.status(t, "e1").Dropped == 1 }, 5*time.Second, 5*time.Millisecond)
	first.Close()

	second := newTestProxy(t, g, nil)
	st := second.converge(t, s)["e1"]
	assert.Equal(t, s.Listen, st.Bound, "the restarted proxy took the same port")
	assert.Zero(t, st.Dropped)
	assert.Zero(t, st.Refused)
	assert.Zero(t, st.Active)
}

// fakeAcceptor replays a script of accept results, then reports closed.
type fakeAcceptor struct {
	script []func() (*net.TCPConn, error)
}

func (f *fakeAcceptor) AcceptTCP() (*net.TCPConn, error) {
	if len(f.script) == 0 {
		return nil, net.ErrClosed
	}
	next := f.script[0]
	f.script = f.script[1:]
	return next()
}
func (f *fakeAcceptor) Close() error { return nil }

// TestAcceptBacksOffWhenOutOfDescriptors: EMFILE/ENFILE leave the caller in
// the backlog, so an accept loop that simply retries spins a core. The loop
// must wait, doubling, reset after a success, and warn once per streak.
func TestAcceptBacksOffWhenOutOfDescriptors(t *testing.T) {
	emfile := func() (*net.TCPConn, error) {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: fmt.Errorf("accept4: %w", syscall.EMFILE)}
	}
	enfile := func() (*net.TCPConn, error) {
		return nil, &net.OpError{Op: "accept", Net: "tcp", Err: syscall.ENFILE}
	}
	ln := listenTCP(t, loopback)
	client := dialTCP(t, ln.Addr().(*net.TCPAddr).AddrPort())
	real := func() (*net.TCPConn, error) { return ln.AcceptTCP() }

	p := newTestProxy(t, newGuests(), nil) // no guest address: the one real caller is dropped
	// Each streak is warnEvery after the last, so each may warn.
	clk := &clock{}
	p.now = func() time.Time { clk.advance(warnEvery); return clk.now() }
	var slept []time.Duration
	p.sleep = func(_ context.Context, d time.Duration) bool {
		slept = append(slept, d)
		return true
	}
	ex := &exposure{id: "e1", conns: make(map[*net.TCPConn]struct{})}
	ex.tgt.Store(&target{vmID: "vm1", port: 80, max: 10})
	fake := &fakeAcceptor{script: []func() (*net.TCPConn, error){
		emfile, emfile, enfile, emfile, real, emfile, emfile,
	}}
	p.wg.Add(1)
	p.serveTCP(ex, &binding{}, fake)

	ms := time.Millisecond
	assert.Equal(t, []time.Duration{5 * ms, 10 * ms, 20 * ms, 40 * ms, 5 * ms, 10 * ms}, slept)
	assert.Equal(t, 2, p.logs.count(slog.LevelWarn, "out of file descriptors"), "one warning per streak")
	expectClosed(t, client)
	require.Eventually(t, func() bool { return ex.dropped.Load() == 1 }, 5*time.Second, 5*time.Millisecond)

	// A long streak tops out instead of growing without bound.
	slept = nil
	many := make([]func() (*net.TCPConn, error), 20)
	for i := range many {
		many[i] = emfile
	}
	p.wg.Add(1)
	p.serveTCP(ex, &binding{}, &fakeAcceptor{script: many})
	assert.Equal(t, acceptBackoffMax, slept[len(slept)-1])
}

// TestAcceptLoopFailureRebinds: a listener failing for a reason other than
// exhaustion is reported failed and rebound on the next Converge.
func TestAcceptLoopFailureRebinds(t *testing.T) {
	p := newTestProxy(t, newGuests(), nil)
	s := tcpSpec("e1", "vm1", 80)
	p.converge(t, s)
	p.mu.Lock()
	b := p.exposures["e1"].b
	p.mu.Unlock()
	// Shut the socket under the loop, the way an unexpected error would end it.
	reason := "accept: invalid argument"
	b.dead.Store(&reason)
	assert.Equal(t, StateFailed, p.status(t, "e1").State)
	st := p.converge(t, s)["e1"]
	assert.True(t, st.Bound.IsValid())
	p.mu.Lock()
	assert.NotSame(t, b, p.exposures["e1"].b, "a new socket was bound")
	p.mu.Unlock()
}
