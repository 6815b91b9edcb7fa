// Package registry holds what each connected host last reported. It is never
// persisted: it lives while the host's stream is up, and a host that is not
// connected has no live facts at all (the API then serves them as absent).
package registry

import (
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// Live is one connected host's latest word. Its messages are replaced whole,
// never mutated, so a copy handed out stays consistent.
type Live struct {
	HostID      string
	Hello       *eitriv1.Hello
	Report      *eitriv1.ActualStateReport // nil until the first report
	ConnectedAt time.Time
	LastSeen    time.Time
	// RefusedSince is when the host's reports started saying it refuses the
	// control plane's snapshots; zero while they do not.
	RefusedSince time.Time

	conn uint64
	vms  map[string]*eitriv1.ActualVM
	exps map[string]*eitriv1.ExposureActual
}

// Diff names what a registry change touched, so the watch hub can rebuild
// exactly those objects.
type Diff struct {
	VMs []string
	// Durable: those of VMs whose durable facts changed (phase, address,
	// error, host key, exits, retry) — or that are new or gone — and so
	// must reach the store. The rest of VMs changed only in narration
	// (status_detail, progress, power), which is commentary: it goes to the
	// watchers straight from here and is never written down.
	Durable   []string
	Exposures []string
	Host      bool
	// Accelerator: the report changed what the host runs guests under.
	Accelerator bool
	// Refusal: the host started or stopped refusing snapshots, or its
	// reason changed.
	Refusal bool
	// Images: what the host says of the images pulled to it changed (or
	// is no longer said: it went away).
	Images bool
}

// Registry is safe for concurrent use.
type Registry struct {
	mu    sync.RWMutex
	hosts map[string]*Live
	seq   uint64
}

// New returns an empty registry.
func New() *Registry { return &Registry{hosts: make(map[string]*Live)} }

// Connect records a new stream for hostID and returns its connection token.
// A newer stream replaces an older one; the old token then no longer applies
// reports or disconnects anything.
func (r *Registry) Connect(hostID string, hello *eitriv1.Hello, now time.Time) (uint64, Diff) {
	r.mu.Lock()
	defer r.mu.Unlock()
	l, d := r.replace(hostID, hello, now)
	r.hosts[hostID] = l
	d.Host = true
	return l.conn, d
}

// replace returns a fresh stream's state for hostID under a new token, and
// everything the stream it replaces (if any) held. r.mu must be held.
func (r *Registry) replace(hostID string, hello *eitriv1.Hello, now time.Time) (*Live, Diff) {
	r.seq++
	var gone Diff
	if old, ok := r.hosts[hostID]; ok {
		gone = everything(old)
	}
	return &Live{HostID: hostID, Hello: hello, ConnectedAt: now, LastSeen: now, conn: r.seq}, gone
}

// Disconnect forgets hostID's live state if conn is still its current stream.
func (r *Registry) Disconnect(hostID string, conn uint64) (Diff, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	l, ok := r.hosts[hostID]
	if !ok || l.conn != conn {
		return Diff{}, false
	}
	delete(r.hosts, hostID)
	d := everything(l)
	d.Host = true
	return d, true
}

func everything(l *Live) Diff {
	var d Diff
	for id := range l.vms {
		d.VMs = append(d.VMs, id)
	}
	d.Durable = d.VMs
	for id := range l.exps {
		d.Exposures = append(d.Exposures, id)
	}
	d.Images = len(l.Report.GetImages()) > 0
	return d
}

// Apply replaces hostID's report with rep (complete, as every report is) and
// returns which objects changed. ok is false when conn is not the host's
// current stream.
func (r *Registry) Apply(hostID string, conn uint64, rep *eitriv1.ActualStateReport, now time.Time) (Diff, bool) {
	vms, exps := index(rep)
	r.mu.Lock()
	defer r.mu.Unlock()
	l, ok := r.hosts[hostID]
	if !ok || l.conn != conn {
		return Diff{}, false
	}
	nl, d := applied(l, rep, vms, exps, now)
	r.hosts[hostID] = nl
	return d, true
}

// ConnectReporting is Connect and then Apply of rep, in one step: a stream
// that arrives with its report already known (another replica's, mirrored
// here) is never seen connected without it, so no caller in between is told
// the host "has not reported its capacity yet".
func (r *Registry) ConnectReporting(hostID string, hello *eitriv1.Hello, rep *eitriv1.ActualStateReport, now time.Time) (uint64, Diff) {
	vms, exps := index(rep)
	r.mu.Lock()
	defer r.mu.Unlock()
	fresh, gone := r.replace(hostID, hello, now)
	nl, d := applied(fresh, rep, vms, exps, now)
	r.hosts[hostID] = nl
	d.VMs = union(gone.VMs, d.VMs)
	d.Durable = union(gone.Durable, d.Durable)
	d.Exposures = union(gone.Exposures, d.Exposures)
	d.Images = d.Images || gone.Images
	d.Host = true
	return nl.conn, d
}

// index maps a report's VMs and exposures by id, outside the lock.
func index(rep *eitriv1.ActualStateReport) (map[string]*eitriv1.ActualVM, map[string]*eitriv1.ExposureActual) {
	vms := make(map[string]*eitriv1.ActualVM, len(rep.GetVms()))
	for _, v := range rep.GetVms() {
		vms[v.GetVmId()] = v
	}
	exps := make(map[string]*eitriv1.ExposureActual, len(rep.GetExposures()))
	for _, e := range rep.GetExposures() {
		exps[e.GetId()] = e
	}
	return vms, exps
}

// applied returns l with rep as its report, and what that changed.
func applied(l *Live, rep *eitriv1.ActualStateReport, vms map[string]*eitriv1.ActualVM, exps map[string]*eitriv1.ExposureActual, now time.Time) (*Live, Diff) {
	var d Diff
	d.VMs = changed(l.vms, vms)
	for _, id := range d.VMs {
		if o, n := l.vms[id], vms[id]; o == nil || n == nil || !sameDurable(o, n) {
			d.Durable = append(d.Durable, id)
		}
	}
	d.Exposures = changed(l.exps, exps)
	old := l.Report
	prevAccel, prevReason := l.Hello.GetAccelerator(), l.Hello.GetAcceleratorReason()
	if old.GetAccelerator() != "" {
		prevAccel, prevReason = old.GetAccelerator(), old.GetAcceleratorReason()
	}
	d.Accelerator = rep.GetAccelerator() != "" && (rep.GetAccelerator() != prevAccel || rep.GetAcceleratorReason() != prevReason)
	d.Refusal = !proto.Equal(old.GetSnapshotRefused(), rep.GetSnapshotRefused())
	d.Images = !sameImages(old.GetImages(), rep.GetImages())
	d.Host = old == nil || d.Accelerator || d.Refusal ||
		!proto.Equal(old.GetCapacity(), rep.GetCapacity()) ||
		!proto.Equal(old.GetMetrics(), rep.GetMetrics()) ||
		!proto.Equal(old.GetUpgrade(), rep.GetUpgrade()) ||
		!sameHeld(old.GetQuarantined(), rep.GetQuarantined())
	// Replace rather than mutate: readers may hold the previous Live.
	nl := *l
	nl.Report, nl.vms, nl.exps, nl.LastSeen = rep, vms, exps, now
	switch {
	case rep.GetSnapshotRefused() == nil:
		nl.RefusedSince = time.Time{}
	case nl.RefusedSince.IsZero():
		nl.RefusedSince = now
	}
	return &nl, d
}

// union is a and b with each id once.
func union(a, b []string) []string {
	seen := make(map[string]bool, len(a)+len(b))
	out := make([]string, 0, len(a)+len(b))
	for _, id := range slices.Concat(a, b) {
		if !seen[id] {
			seen[id] = true
			out = append(out, id)
		}
	}
	return out
}

// sameDurable says whether two rows for one VM agree on everything the
// control plane keeps about it.
func sameDurable(a, b *eitriv1.ActualVM) bool {
	return a.GetPhase() == b.GetPhase() && a.GetIp() == b.GetIp() && a.GetLastError() == b.GetLastError() &&
		a.GetSshHostPubkey() == b.GetSshHostPubkey() && a.GetUnexpectedExits() == b.GetUnexpectedExits() &&
		a.GetRetry() == b.GetRetry() && proto.Equal(a.GetLastExit(), b.GetLastExit())
}

// sameHeld says whether two reports hold the same VMs apart from their
// readings (power), which the host's conditions do not show.
func sameHeld(a, b []*eitriv1.QuarantinedVM) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].GetVmId() != b[i].GetVmId() || a[i].GetReason() != b[i].GetReason() {
			return false
		}
	}
	return true
}

func sameImages(a, b []*eitriv1.ImageHeld) bool {
	return slices.EqualFunc(a, b, func(x, y *eitriv1.ImageHeld) bool { return proto.Equal(x, y) })
}

func changed[M proto.Message](old, cur map[string]M) []string {
	var out []string
	for id, v := range cur {
		if o, ok := old[id]; !ok || !proto.Equal(o, v) {
			out = append(out, id)
		}
	}
	for id := range old {
		if _, ok := cur[id]; !ok {
			out = append(out, id)
		}
	}
	return out
}

// Host returns hostID's live state, if connected.
func (r *Registry) Host(hostID string) (Live, bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	l, ok := r.hosts[hostID]
	if !ok {
		return Live{}, false
	}
	return *l, true
}

// Connected reports whether hostID has a stream up.
func (r *Registry) Connected(hostID string) bool {
	_, ok := r.Host(hostID)
	return ok
}

// VM returns the row hostID last reported for vmID. reporting is true when
// the host is connected and has sent at least one report.
func (r *Registry) VM(hostID, vmID string) (row *eitriv1.ActualVM, reporting bool) {
	r.mu.RLock()
	defer r.mu.RUnlock()
	l, ok := r.hosts[hostID]
	if !ok || l.Report == nil {
		return nil, false
	}
	return l.vms[vmID], true
}

// Exposure returns the row hostID last reported for exposure id, or nil.
func (r *Registry) Exposure(hostID, id string) *eitriv1.ExposureActual {
	r.mu.RLock()
	defer r.mu.RUnlock()
	l, ok := r.hosts[hostID]
	if !ok {
		return nil
	}
	return l.exps[id]
}
