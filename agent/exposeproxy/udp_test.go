package exposeproxy

import (
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestUDPEchoThroughProxy(t *testing.T) {
	port := udpGuest(t, netip.AddrPortFrom(loopback, 0), "echo:")
	p := newTestProxy(t, newGuests("vm1", loopback), nil)
	bound := p.converge(t, udpSpec("e1", "vm1", port))["e1"].Bound

	a, b := udpClient(t, bound), udpClient(t, bound)
	assert.Equal(t, "echo:one", say(t, a, "one"))
	assert.Equal(t, "echo:two", say(t, b, "two"))
	assert.Equal(t, "echo:three", say(t, a, "three"), "a client keeps its session")

	big := make([]byte, 60000)
	for i := range big {
		big[i] = byte(i)
	}
	assert.True(t, "echo:"+string(big) == say(t, a, string(big)), "a near-maximal datagram is carried whole")

	// Payloads only, each way; the reply leg is counted once it is sent, so
	// the client may read it a moment before.
	in := int64(len("one") + len("two") + len("three") + len(big))
	out := in + 4*int64(len("echo:"))
	require.Eventually(t, func() bool {
		st := p.status(t, "e1")
		return st.BytesIn == in && st.BytesOut == out
	}, 5*time.Second, 5*time.Millisecond, "bytes in/out: want %d/%d, have %+v", in, out, p.status(t, "e1"))
	st := p.status(t, "e1")
	assert.Equal(t, int64(2), st.Active, "one session per client")
	assert.Zero(t, st.Refused)
	assert.Zero(t, st.Dropped)
	assert.Equal(t, 2, p.logs.count(slog.LevelDebug, "session opened"))
}

// TestUDPCapRefusesNewClients: a full table turns new clients away (their
// datagrams go nowhere) while established conversations carry on, and the
// saturation warns once per streak.
func TestUDPCapRefusesNewClients(t *testing.T) {
	port := udpGuest(t, netip.AddrPortFrom(loopback, 0), "echo:")
	p := newTestProxy(t, newGuests("vm1", loopback), func(c *Config) { c.MaxSessions = 1 })
	bound := p.converge(t, udpSpec("e1", "vm1", port))["e1"].Bound

	held := udpClient(t, bound)
	require.Equal(t, "echo:mine", say(t, held, "mine"))
	over := udpClient(t, bound)
	for range 3 {
		sayUnanswered(t, over, "me too")
	}
	require.Eventually(t, func() bool { return p.status(t, "e1").Refused == 3 }, 5*time.Second, 5*time.Millisecond)
	st := p.status(t, "e1")
	assert.Equal(t, int64(1), st.Active)
	assert.Zero(t, st.Dropped)
	assert.Equal(t, "echo:still", say(t, held, "still"), "the working conversation is untouched")
	assert.Equal(t, 1, p.logs.count(slog.LevelWarn, "session cap"), "one warning for the streak")
	assert.Equal(t, 3, p.logs.count(slog.LevelDebug, "refused a session"))
}

func TestUDPDropsWithoutGuestAddress(t *testing.T) {
	p := newTestProxy(t, newGuests(), nil)
	bound := p.converge(t, udpSpec("e1", "vm1", 9999))["e1"].Bound
	c := udpClient(t, bound)
	sayUnanswered(t, c, "anyone there")
	require.Eventually(t, func() bool { return p.status(t, "e1").Dropped == 1 }, 5*time.Second, 5*time.Millisecond)
	st := p.status(t, "e1")
	assert.Zero(t, st.Refused, "a guest still leasing is not a port at its cap")
	assert.Zero(t, st.Active, "a dropped datagram starts no session")
	assert.Zero(t, st.BytesIn, "a dropped datagram was not carried")
}

// TestUDPSendToClosedGuestPortDrops: the ICMP port-unreachable that comes
// back ends the session and counts the datagram as dropped.
func TestUDPSendToClosedGuestPortDrops(t *testing.T) {
	p := newTestProxy(t, newGuests("vm1", loopback), nil)
	bound := p.converge(t, udpSpec("e1", "vm1", closedPort(t)))["e1"].Bound
	c := udpClient(t, bound)
	sayUnanswered(t, c, "hello?")
	require.Eventually(t, func() bool { return p.status(t, "e1").Dropped >= 1 }, 5*time.Second, 5*time.Millisecond)
	p.waitActive(t, "e1", 0)
}

// TestUDPIdleExpiry: sessions expire when idle, sooner while the guest has
// never answered (a one-way sender should not hold a slot as long as a real
// conversation).
func TestUDPIdleExpiry(t *testing.T) {
	const short, long = 100 * time.Millisecond, time.Hour
	cases := []struct {
		name          string
		answer        string // "" = guest never replies
		unreplied     time.Duration
		replied       time.Duration
		expectExpired bool
	}{
		{"unanswered session expires on the short limit", "", short, long, true},
		{"answered session outlives the short limit", "echo:", short, long, false},
		{"answered session expires on the long limit", "echo:", short, 300 * time.Millisecond, true},
		{"a reply switches to a shorter replied limit", "echo:", long, short, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			port := udpGuest(t, netip.AddrPortFrom(loopback, 0), tc.answer)
			p := newTestProxy(t, newGuests("vm1", loopback), func(c *Config) {
				c.UnrepliedIdle, c.RepliedIdle = tc.unreplied, tc.replied
			})
			bound := p.converge(t, udpSpec("e1", "vm1", port))["e1"].Bound
			c := udpClient(t, bound)
			if tc.answer != "" {
				require.Equal(t, tc.answer+"hi", say(t, c, "hi"))
			} else {
				_, err := c.Write([]byte("hi"))
				require.NoError(t, err)
			}
			p.waitActive(t, "e1", 1)
			if tc.expectExpired {
				p.waitActive(t, "e1", 0)
				assert.Equal(t, 1, p.logs.count(slog.LevelDebug, "session closed"))
			} else {
				time.Sleep(5 * short)
				assert.Equal(t, int64(1), p.status(t, "e1").Active, "expired on the unreplied limit after a reply")
			}
			assert.Zero(t, p.status(t, "e1").Dropped, "expiry is neither a drop")
			assert.Zero(t, p.status(t, "e1").Refused, "nor a refusal")
		})
	}
}

// TestUDPGuestMoveEvictsSessions: when a guest's address changes, sessions
// still connected to the old address are ended on the next Converge, and the
// client's next datagram reaches the guest where it is now.
func TestUDPGuestMoveEvictsSessions(t *testing.T) {
	port := udpGuest(t, netip.AddrPortFrom(loopback, 0), "old:")
	moved := netip.MustParseAddr("127.0.0.2")
	udpGuest(t, netip.AddrPortFrom(moved, port), "new:")

	g := newGuests("vm1", loopback)
	p := newTestProxy(t, g, nil)
	s := udpSpec("e1", "vm1", port)
	bound := p.converge(t, s)["e1"].Bound
	c := udpClient(t, bound)
	require.Equal(t, "old:hi", say(t, c, "hi"))
	p.waitActive(t, "e1", 1)

	p.converge(t, s)
	assert.Equal(t, int64(1), p.status(t, "e1").Active, "an unchanged address keeps the session")

	g.set("vm1", moved)
	assert.Zero(t, p.converge(t, s)["e1"].Active, "the stale session is gone from the report at once")
	assert.Equal(t, "new:hi", say(t, c, "hi"))
	p.waitActive(t, "e1", 1)
	st := p.status(t, "e1")
	assert.Zero(t, st.Dropped, "eviction drops nothing")
	assert.Zero(t, st.Refused)
}

// TestUDPRemovalEndsSessions: a removed UDP exposure takes its sessions with
// it, and a rebind starts the table fresh while keeping the totals.
func TestUDPRemovalEndsSessions(t *testing.T) {
	port := udpGuest(t, netip.AddrPortFrom(loopback, 0), "echo:")
	p := newTestProxy(t, newGuests("vm1", loopback), func(c *Config) { c.MaxSessions = 1 })
	s := udpSpec("e1", "vm1", port)
	bound := p.converge(t, s)["e1"].Bound
	require.Equal(t, "echo:a", say(t, udpClient(t, bound), "a"))
	sayUnanswered(t, udpClient(t, bound), "b")
	require.Eventually(t, func() bool { return p.status(t, "e1").Refused == 1 }, 5*time.Second, 5*time.Millisecond)

	// Rebind on a different port: sessions reply through the old socket, so
	// they go; the refusal total stays.
	s.Listen = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.3"), 0)
	st := p.converge(t, s)["e1"]
	assert.Zero(t, st.Active)
	assert.Equal(t, int64(1), st.Refused)
	require.Equal(t, "echo:c", say(t, udpClient(t, st.Bound), "c"))

	assert.Empty(t, p.Converge(nil))
	assert.Empty(t, p.Status())
}

// gate, once armed, holds the next Resolve until opened, so a test can queue
// datagrams on the published port while the proxy is busy and have them read
// as a batch. (Converge resolves too, so it is armed after the port is up.)
type gate struct {
	entered, open chan struct{}
	armed         atomic.Bool
	once          sync.Once
	next          Resolver
}

func newGate(next Resolver) *gate {
	return &gate{entered: make(chan struct{}), open: make(chan struct{}), next: next}
}

func (g *gate) resolve(vm string) (netip.Addr, bool) {
	if !g.armed.Load() {
		return g.next(vm)
	}
	g.once.Do(func() {
		close(g.entered)
		<-g.open
	})
	return g.next(vm)
}

// TestUDPBatchKeepsCountsExact: datagrams from many clients read in batches
// are each either carried, in order per client, or counted; the cap holds
// exactly.
func TestUDPBatchKeepsCountsExact(t *testing.T) {
	const clients, each, limit = 8, 10, 3
	port := udpGuest(t, netip.AddrPortFrom(loopback, 0), "echo:")
	g := newGate(newGuests("vm1", loopback).resolve)
	p := newTestProxy(t, newGuests(), func(c *Config) { c.Resolve, c.MaxSessions = g.resolve, limit })
	bound := p.converge(t, udpSpec("e1", "vm1", port))["e1"].Bound

	cs := make([]*net.UDPConn, clients)
	for i := range cs {
		cs[i] = udpClient(t, bound)
	}
	send := func(i, j int) {
		_, err := cs[i].Write(fmt.Appendf(nil, "c%d-%d", i, j))
		require.NoError(t, err)
	}
	g.armed.Store(true)
	send(0, 0)
	<-g.entered // the proxy is stuck on the first datagram; queue the rest
	for i := range cs {
		for j := range each {
			if i > 0 || j > 0 {
				send(i, j)
			}
		}
	}
	close(g.open)

	buf := make([]byte, 64)
	for i := range limit {
		require.NoError(t, cs[i].SetReadDeadline(time.Now().Add(5*time.Second)))
		for j := range each {
			n, err := cs[i].Read(buf)
			require.NoError(t, err, "client %d answer %d", i, j)
			require.Equal(t, fmt.Sprintf("echo:c%d-%d", i, j), string(buf[:n]))
		}
	}
	require.Eventually(t, func() bool { return p.status(t, "e1").Refused == (clients-limit)*each },
		5*time.Second, 5*time.Millisecond)
	st := p.status(t, "e1")
	assert.Equal(t, int64(limit), st.Active)
	assert.Zero(t, st.Dropped)
	assert.Equal(t, limit, p.logs.count(slog.LevelDebug, "session opened"))
	for i := limit; i < clients; i++ {
		sayUnanswered(t, cs[i], "still full")
	}
	assert.Equal(t, int64((clients-limit)*(each+1)), p.status(t, "e1").Refused)
}

// TestUDPBatchDropsEachDatagram: with no guest address, every datagram of a
// batch counts as one drop and none starts a session.
func TestUDPBatchDropsEachDatagram(t *testing.T) {
	const clients, each = 3, 7
	g := newGate(newGuests().resolve)
	p := newTestProxy(t, newGuests(), func(c *Config) { c.Resolve = g.resolve })
	bound := p.converge(t, udpSpec("e1", "vm1", 9999))["e1"].Bound
	cs := make([]*net.UDPConn, clients)
	for i := range cs {
		cs[i] = udpClient(t, bound)
	}
	g.armed.Store(true)
	_, err := cs[0].Write([]byte("first"))
	require.NoError(t, err)
	<-g.entered
	for i := range clients * each {
		if i > 0 {
			_, err := cs[i%clients].Write([]byte("more"))
			require.NoError(t, err)
		}
	}
	close(g.open)
	require.Eventually(t, func() bool { return p.status(t, "e1").Dropped == clients*each },
		5*time.Second, 5*time.Millisecond)
	sayUnanswered(t, cs[1], "last")
	st := p.status(t, "e1")
	assert.Equal(t, int64(clients*each+1), st.Dropped)
	assert.Zero(t, st.Active)
	assert.Zero(t, st.Refused)
}

// TestUDPTrafficKeepsSessionAlive: the idle deadline is armed once and
// re-armed when it fires early, so a conversation that keeps moving (even one
// way, the guest never answering) outlives the limit in a single session, and
// expires once it stops.
func TestUDPTrafficKeepsSessionAlive(t *testing.T) {
	for _, answer := range []string{"", "echo:"} {
		t.Run(fmt.Sprintf("answer=%q", answer), func(t *testing.T) {
			const limit = time.Second // well above a scheduling stall on a loaded machine
			port := udpGuest(t, netip.AddrPortFrom(loopback, 0), answer)
			p := newTestProxy(t, newGuests("vm1", loopback), func(c *Config) {
				c.UnrepliedIdle, c.RepliedIdle = limit, limit
			})
			bound := p.converge(t, udpSpec("e1", "vm1", port))["e1"].Bound
			c := udpClient(t, bound)
			for end := time.Now().Add(5 * limit / 2); time.Now().Before(end); {
				if answer != "" {
					require.Equal(t, "echo:tick", say(t, c, "tick"))
				} else {
					_, err := c.Write([]byte("tick"))
					require.NoError(t, err)
				}
				time.Sleep(limit / 10)
			}
			assert.Equal(t, int64(1), p.status(t, "e1").Active)
			p.waitActive(t, "e1", 0)
			assert.Equal(t, 1, p.logs.count(slog.LevelDebug, "session opened"), "one session throughout")
			assert.Zero(t, p.status(t, "e1").Dropped)
		})
	}
}
