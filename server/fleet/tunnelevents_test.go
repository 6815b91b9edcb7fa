package fleet

import (
	"context"
	"encoding/base64"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/callrelay"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/vmstate"
)

// eventsFleet is a fleet over a real store holding users u1 (alice), u2
// (bob) and a VM vm-1, whose tunnel windows end only when the test says.
type eventsFleet struct {
	*Fleet
	st   *store.Store
	mu   sync.Mutex
	ends []func()
}

func newEventsFleet(t *testing.T) *eventsFleet {
	t.Helper()
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "eitri.db"))
	require.NoError(t, err)
	t.Cleanup(func() { st.Close() })
	for _, u := range []store.User{{ID: "u1", Name: "alice"}, {ID: "u2", Name: "bob"}} {
		require.NoError(t, st.CreateUser(ctx, u))
	}
	_, err = st.CreateVM(ctx, store.VM{ID: "vm-1", OwnerID: "u1", Name: "web", PowerState: vmstate.PowerStopped})
	require.NoError(t, err)
	e := &eventsFleet{Fleet: New(Config{}, st), st: st}
	e.tunnelEvents.after = func(_ time.Duration, fn func()) {
		e.mu.Lock()
		defer e.mu.Unlock()
		e.ends = append(e.ends, fn)
	}
	return e
}

// endWindows ends every open window, as its timer would.
func (e *eventsFleet) endWindows() {
	e.mu.Lock()
	ends := e.ends
	e.ends = nil
	e.mu.Unlock()
	for _, fn := range ends {
		fn()
	}
}

// tunnel records one tunnel's end as OpenTunnel does; refused ones end as
// a stopped VM's host refuses them.
func (e *eventsFleet) tunnel(p auth.Principal, port uint32, refused bool) {
	t := callrelay.TunnelEnd{VMID: "vm-1", Caller: p, Port: port, Opened: e.now(), How: "closed by both sides"}
	if refused {
		t.How = "failed: vm vm-1 is not running"
		t.Err = errorf(Precondition, "%s", "vm vm-1 is not running")
	} else {
		t.Up, t.Down = 10, 100
	}
	e.tunnelEnded(context.Background(), t)
}

func (e *eventsFleet) timeline(t *testing.T) []string {
	t.Helper()
	evs, err := e.st.ListVMEvents(context.Background(), "vm-1")
	require.NoError(t, err)
	out := make([]string, len(evs))
	for i, ev := range evs {
		out[i] = ev.Message
	}
	return out
}

var (
	alice = auth.Principal{UserID: "u1", Name: "alice"}
	bob   = auth.Principal{UserID: "u2", Name: "bob"}
)

func TestTunnelsPastTheFirstTenAMinuteAreCountedInOneEvent(t *testing.T) {
	type tun struct {
		p       auth.Principal
		port    uint32
		refused bool
	}
	many := func(n int, p auth.Principal, port uint32, refused bool) []tun {
		out := make([]tun, n)
		for i := range out {
			out[i] = tun{p, port, refused}
		}
		return out
	}
	for _, c := range []struct {
		name     string
		tunnels  []tun
		single   int      // events of one tunnel each
		summary  []string // what the window's last event says, in order; nil: none
		nSummary int
	}{
		{name: "a few tunnels are each recorded", tunnels: many(3, alice, 22, false), single: 3},
		{name: "exactly the window's share writes no summary", tunnels: many(tunnelEventsPerWindow, alice, 22, true), single: tunnelEventsPerWindow},
		{
			name:    "a flood of refused tunnels is ten events and a count",
			tunnels: many(5000, alice, 22, true), single: tunnelEventsPerWindow, nSummary: 1,
			summary: []string{"4990 more tunnels to port 22 by alice between ", "counted but not recorded one by one",
				"0 bytes to the guest, 0 bytes from it; 4990 failed (the last: failed: vm vm-1 is not running)"},
		},
		{
			name: "the count says which ports and what went through",
			tunnels: append(many(tunnelEventsPerWindow, alice, 22, false),
				append(many(2, alice, 80, false), append(many(1, alice, 22, true), many(1, alice, 443, false)...)...)...),
			single: tunnelEventsPerWindow, nSummary: 1,
			summary: []string{"4 more tunnels to ports 80, 22, 443 by alice", "30 bytes to the guest, 300 bytes from it; 1 failed"},
		},
		{
			name:    "the ports named are bounded",
			tunnels: append(many(tunnelEventsPerWindow, alice, 1, false), []tun{{alice, 1, false}, {alice, 2, false}, {alice, 3, false}, {alice, 4, false}, {alice, 5, false}, {alice, 6, false}, {alice, 7, false}}...),
			single:  tunnelEventsPerWindow, nSummary: 1,
			summary: []string{"7 more tunnels to ports 1, 2, 3, 4, 5, … by alice"},
		},
		{
			name:    "each user has a share of their own",
			tunnels: append(many(tunnelEventsPerWindow+1, alice, 22, false), many(tunnelEventsPerWindow, bob, 22, false)...),
			single:  2 * tunnelEventsPerWindow, nSummary: 1,
			summary: []string{"1 more tunnel to port 22 by alice"},
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			e := newEventsFleet(t)
			for _, tu := range c.tunnels {
				e.tunnel(tu.p, tu.port, tu.refused)
			}
			during := e.timeline(t)
			assert.Len(t, during, c.single, "while the window is open only the tunnels recorded one by one are in")
			e.endWindows()
			after := e.timeline(t)
			require.Len(t, after, c.single+c.nSummary)
			for _, ev := range after[:c.single] {
				assert.Regexp(t, `^tunnel to port \d+ by (alice|bob), opened `, ev)
			}
			if c.nSummary > 0 {
				last := after[len(after)-1]
				for _, s := range c.summary {
					assert.Contains(t, last, s)
				}
			}
		})
	}
}

func TestTheNextWindowRecordsTunnelsOneByOneAgain(t *testing.T) {
	e := newEventsFleet(t)
	for range tunnelEventsPerWindow + 3 {
		e.tunnel(alice, 22, true)
	}
	e.endWindows()
	e.tunnel(alice, 22, false)
	evs := e.timeline(t)
	require.Len(t, evs, tunnelEventsPerWindow+2)
	assert.Contains(t, evs[tunnelEventsPerWindow], "3 more tunnels to port 22 by alice")
	assert.Contains(t, evs[tunnelEventsPerWindow+1], "tunnel to port 22 by alice, opened ")
	e.endWindows()
	assert.Len(t, e.timeline(t), tunnelEventsPerWindow+2, "a window that counted nothing adds nothing")
	assert.Empty(t, e.tunnelEvents.open, "ended windows are forgotten")
}

func TestAPageTokenRoundTripsAndAnyOtherIsRefused(t *testing.T) {
	c := store.VMEventCursor{At: time.Date(2026, 3, 4, 5, 6, 7, 123456789, time.UTC), ID: 42}
	got, err := parseEventsToken(eventsToken(c))
	require.NoError(t, err)
	assert.Equal(t, c, got)
	for _, tok := range []string{
		"!", "e1.1.2", // not base64
		eventsB64("e2.1.2"), eventsB64("e1.1"), eventsB64("e1.x.2"), eventsB64("e1.1.x"),
		eventsB64("e1.1.0"), eventsB64("e1.1.-3"), eventsB64(""),
	} {
		_, err := parseEventsToken(tok)
		assert.Equal(t, Invalid, KindOf(err), "%q", tok)
		assert.ErrorContains(t, err, "page_token: ", "%q", tok)
	}
}

func eventsB64(s string) string { return base64.RawURLEncoding.EncodeToString([]byte(s)) }
