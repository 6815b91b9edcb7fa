package fleet

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/a73x/eitri/server/callrelay"
)

// What a VM's timeline hears of its tunnels. Each tunnel is recorded on
// its own, up to tunnelEventsPerWindow of one user's to one VM in a
// tunnelEventWindow; past that they are counted, and one event at the end
// of the window says how many more there were and how they went. A user
// opening and dropping tunnels in a loop (to a stopped VM: every one
// refused) writes a dozen events a minute, not thousands, and the
// timeline still shows the first ones whole and the total.
const (
	tunnelEventWindow     = time.Minute
	tunnelEventsPerWindow = 10
	// tunnelSummaryPorts bounds the ports a summary names.
	tunnelSummaryPorts = 5
)

// tunnelEvents is the open windows, by VM and user.
type tunnelEvents struct {
	mu   sync.Mutex
	open map[tunnelEventKey]*tunnelWindow
	// after runs fn once d has passed (nil: time.AfterFunc); tests end
	// windows themselves.
	after func(d time.Duration, fn func())
}

type tunnelEventKey struct{ vmID, userID string }

// tunnelWindow is one user's tunnels to one VM since start.
type tunnelWindow struct {
	start      time.Time
	user       string
	recorded   int // one event each
	held       int // only counted, below
	failed     int
	up, down   int64
	ports      []uint32
	morePorts  bool
	lastFailed string
}

// tunnelEnded records a tunnel that reached the VM's host: on its own
// while its window has room, counted otherwise.
func (f *Fleet) tunnelEnded(ctx context.Context, t callrelay.TunnelEnd) {
	vmID, p, port := t.VMID, t.Caller, t.Port
	te := &f.tunnelEvents
	key := tunnelEventKey{vmID, p.UserID}
	te.mu.Lock()
	if te.open == nil {
		te.open = map[tunnelEventKey]*tunnelWindow{}
	}
	w := te.open[key]
	if w == nil {
		w = &tunnelWindow{start: f.now(), user: p.Name}
		te.open[key] = w
		after := te.after
		if after == nil {
			after = func(d time.Duration, fn func()) { time.AfterFunc(d, fn) }
		}
		after(tunnelEventWindow, func() { f.endTunnelWindow(key) })
	}
	if w.recorded < tunnelEventsPerWindow {
		w.recorded++
		te.mu.Unlock()
		f.event(ctx, vmID, "tunnel", fmt.Sprintf("tunnel to port %d by %s, opened %s: %d bytes to the guest, %d bytes from it; %s",
			port, p.Name, t.Opened.UTC().Format(time.RFC3339), t.Up, t.Down, t.How))
		return
	}
	w.held++
	w.up += t.Up
	w.down += t.Down
	if t.Err != nil {
		w.failed++
		w.lastFailed = t.How
	}
	if !slices.Contains(w.ports, port) {
		if len(w.ports) < tunnelSummaryPorts {
			w.ports = append(w.ports, port)
		} else {
			w.morePorts = true
		}
	}
	te.mu.Unlock()
}

// endTunnelWindow closes a window, recording what it only counted.
func (f *Fleet) endTunnelWindow(key tunnelEventKey) {
	te := &f.tunnelEvents
	te.mu.Lock()
	w := te.open[key]
	delete(te.open, key)
	te.mu.Unlock()
	if w == nil || w.held == 0 {
		return
	}
	f.event(context.Background(), key.vmID, "tunnel", w.summary(f.now()))
}

// summary is the event for the tunnels a window only counted.
func (w *tunnelWindow) summary(end time.Time) string {
	ports := make([]string, len(w.ports))
	for i, p := range w.ports {
		ports[i] = fmt.Sprint(p)
	}
	if w.morePorts {
		ports = append(ports, "…")
	}
	word := "port"
	if len(ports) > 1 {
		word = "ports"
	}
	tunnels := "tunnels"
	if w.held == 1 {
		tunnels = "tunnel"
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d more %s to %s %s by %s between %s and %s, counted but not recorded one by one: ",
		w.held, tunnels, word, strings.Join(ports, ", "), w.user,
		w.start.UTC().Format(time.RFC3339), end.UTC().Format(time.RFC3339))
	fmt.Fprintf(&b, "%d bytes to the guest, %d bytes from it; %d failed", w.up, w.down, w.failed)
	if w.failed > 0 {
		fmt.Fprintf(&b, " (the last: %s)", w.lastFailed)
	}
	return b.String()
}
