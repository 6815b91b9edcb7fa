package exposeproxy

import (
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// plainEchoGuest echoes with a read/write loop, so the guest side holds
// exactly one descriptor per connection (io.Copy would splice and keep a
// pipe while idle).
func plainEchoGuest(t testing.TB) uint16 {
	return serveGuest(t, func(c *net.TCPConn) {
		buf := make([]byte, 512)
		for {
			n, err := c.Read(buf)
			if n > 0 {
				if _, werr := c.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	})
}

func openFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// openFDsOf counts this process's descriptors of one kind ("socket", "pipe").
func openFDsOf(t *testing.T, kind string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	n := 0
	for _, e := range ents {
		if to, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(to, kind+":") {
			n++
		}
	}
	return n
}

// settle polls on the calling goroutine (require.Eventually runs its
// condition on goroutines of its own, which would be counted) until now()
// is at most want.
func settle(t *testing.T, what string, now func() int, want int) {
	t.Helper()
	for end := time.Now().Add(10 * time.Second); now() > want; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("%s: %d, want at most %d", what, now(), want)
		}
	}
}

// gcThen collects garbage before counting: Go keeps splice pipes in a pool
// until a collection empties it and their finalizers close them.
func gcThen(count func() int) func() int {
	return func() int {
		runtime.GC()
		return count()
	}
}

func echoByte(t *testing.T, c *net.TCPConn) {
	t.Helper()
	_, err := c.Write([]byte{'x'})
	require.NoError(t, err)
	_, err = io.ReadFull(c, make([]byte, 1))
	require.NoError(t, err)
}

// TestTCPHeldConnectionsReturnToBaseline: many connections held through one
// published port each cost the proxy two descriptors (no splice pipe while
// idle), all keep carrying, and once they close the process's goroutines and
// descriptors return to where they started. hold.sh is the same at 20,000.
func TestTCPHeldConnectionsReturnToBaseline(t *testing.T) {
	const n = 300
	port := plainEchoGuest(t)
	p := newTestProxy(t, newGuests("vm1", loopback), func(c *Config) { c.MaxConns = n })
	bound := p.converge(t, tcpSpec("e1", "vm1", port))["e1"].Bound

	runtime.GC()
	baseFDs, baseSockets, basePipes, baseG := openFDs(t), openFDsOf(t, "socket"), openFDsOf(t, "pipe"), runtime.NumGoroutine()

	conns := make([]*net.TCPConn, n)
	for i := range conns {
		conns[i] = dialTCP(t, bound)
		echoByte(t, conns[i])
	}
	p.waitActive(t, "e1", n)
	for _, c := range conns {
		echoByte(t, c) // every held connection still carries
	}
	// Per connection: the client's socket, the guest's, and the proxy's two.
	assert.InDelta(t, 4*n, openFDsOf(t, "socket")-baseSockets, 8)
	// And no pipe: a splice waiting for data would hold one per direction.
	settle(t, "pipes while holding", gcThen(func() int { return openFDsOf(t, "pipe") }), basePipes+8)
	st := p.status(t, "e1")
	assert.Zero(t, st.Refused)
	assert.Zero(t, st.Dropped)

	for _, c := range conns {
		c.Close()
	}
	p.waitActive(t, "e1", 0)
	settle(t, "goroutines", runtime.NumGoroutine, baseG)
	settle(t, "descriptors", gcThen(func() int { return openFDs(t) }), baseFDs)
}
