// Package node is one host as the control plane sees it: the reconcile
// engine's VMs, the published ports, and the host's capacity and load,
// gathered into the complete report the sync client sends, and fed each
// desired snapshot.
package node

import (
	"context"
	"log/slog"
	"net/netip"
	"slices"
	"sync"

	"github.com/a73x/eitri/agent/exposeproxy"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// Engine is what node needs of the reconcile engine.
type Engine interface {
	Apply(*eitriv1.DesiredStateSnapshot) bool
	Fill(*eitriv1.ActualStateReport)
	Changed() <-chan struct{}
}

// Ports is what node needs of the exposure proxy.
type Ports interface {
	Converge([]exposeproxy.Spec) []exposeproxy.Status
	Status() []exposeproxy.Status
}

// Records is where node keeps the published ports across agent restarts
// (the agent's state store).
type Records interface {
	SaveExposures([]state.Exposure) error
	LoadExposures() ([]state.Exposure, bool, error)
}

// Node composes one host's report.
type Node struct {
	eng       Engine
	ports     Ports
	records   Records
	guestAddr func(vmID string) (netip.Addr, bool)
	capacity  func() *eitriv1.Capacity
	metrics   func() *eitriv1.Metrics
	accel     func() (name, reason string)
	log       *slog.Logger

	changed chan struct{}

	mu       sync.RWMutex
	addrs    map[string]netip.Addr // vm id → guest address, for the proxy
	reported map[string]bool       // vm ids the engine has a row for
	// engine is the engine's part of the report as Run last built it (to
	// read the addresses): Fill sends that same build instead of a second
	// one. nil until Run has seen a change.
	engine    *eitriv1.ActualStateReport
	exposures []*eitriv1.ExposureDesired
	applied   bool // a snapshot has been applied since start

	// saveMu keeps a slow disk off Resolve's lock.
	saveMu sync.Mutex
	saved  []state.Exposure // what Records holds, as far as this process knows
}

// Config wires a Node.
type Config struct {
	Engine   Engine
	Ports    Ports
	Capacity func() *eitriv1.Capacity // nil: capacity not reported
	Metrics  func() *eitriv1.Metrics  // nil: metrics not reported
	// Accelerator is what new guests start under and why; it can change
	// when the hypervisor re-probes. nil: said only in Hello.
	Accelerator func() (name, reason string)
	// Records keeps the published ports so Restore can serve them again
	// after a restart; nil: not kept.
	Records Records
	// GuestAddr is the host's own word on a guest's address, asked for a VM
	// the engine has no row for yet (after a restart, before the first
	// snapshot or pass); nil: such a VM has no address.
	GuestAddr func(vmID string) (netip.Addr, bool)
	Log       *slog.Logger
}

// New returns a node; call Run to follow guest address changes.
func New(cfg Config) *Node {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Node{eng: cfg.Engine, ports: cfg.Ports, records: cfg.Records, guestAddr: cfg.GuestAddr,
		capacity: cfg.Capacity, metrics: cfg.Metrics, accel: cfg.Accelerator, log: cfg.Log,
		addrs: map[string]netip.Addr{}, reported: map[string]bool{}, changed: make(chan struct{}, 1)}
}

// Resolve is the exposure proxy's guest-address lookup.
func (n *Node) Resolve(vmID string) (netip.Addr, bool) {
	n.mu.RLock()
	a, ok := n.addrs[vmID]
	known := n.reported[vmID]
	n.mu.RUnlock()
	if ok || known || n.guestAddr == nil {
		return a, ok
	}
	// The engine says nothing of this VM yet, but its port is published:
	// ask the host, so a restarted agent serves its guests at once.
	return n.guestAddr(vmID)
}

// Restore serves the published ports saved by an earlier run, so they come
// back before the control plane answers (or while it is down). A snapshot
// applied since start wins: it is newer than anything saved.
func (n *Node) Restore() error {
	if n.records == nil {
		return nil
	}
	saved, ok, err := n.records.LoadExposures()
	if err != nil || !ok {
		return err
	}
	n.saveMu.Lock()
	n.mu.Lock()
	if n.applied {
		n.mu.Unlock()
		n.saveMu.Unlock()
		return nil
	}
	n.saved = saved
	n.exposures = make([]*eitriv1.ExposureDesired, len(saved))
	for i, e := range saved {
		n.exposures[i] = &eitriv1.ExposureDesired{
			Id: e.ID, VmId: e.VMID, Protocol: e.Protocol, Scope: e.Scope,
			HostPort: uint32(e.HostPort), GuestPort: uint32(e.GuestPort), MaxSessions: e.MaxSessions,
		}
	}
	n.mu.Unlock()
	n.saveMu.Unlock()
	n.log.Info("published ports restored from the last snapshot", "count", len(saved))
	n.converge()
	return nil
}

// Run re-reads guest addresses whenever the engine's aggregate changes and
// re-converges the ports when one moved (so sessions to an old address are
// evicted). It returns when ctx ends.
func (n *Node) Run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.eng.Changed():
			if n.refreshAddrs() {
				n.converge()
			}
			select {
			case n.changed <- struct{}{}:
			default:
			}
		}
	}
}

// Changed signals that the VMs' aggregate may have changed (forwarded from
// the engine once the ports have caught up with it).
func (n *Node) Changed() <-chan struct{} { return n.changed }

func (n *Node) refreshAddrs() bool {
	rep := &eitriv1.ActualStateReport{}
	n.eng.Fill(rep)
	next := make(map[string]netip.Addr, len(rep.GetVms()))
	reported := make(map[string]bool, len(rep.GetVms()))
	for _, v := range rep.GetVms() {
		reported[v.GetVmId()] = true
		// A stopped guest has no address worth dialing, whatever it last had.
		if v.GetPower() != vmstate.PowerRunning {
			continue
		}
		if a, err := netip.ParseAddr(v.GetIp()); err == nil {
			next[v.GetVmId()] = a
		}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	changed := len(next) != len(n.addrs)
	for id, a := range next {
		if n.addrs[id] != a {
			changed = true
		}
	}
	n.addrs, n.reported, n.engine = next, reported, rep
	return changed
}

// Apply hands a snapshot to the engine and converges the published ports.
func (n *Node) Apply(snap *eitriv1.DesiredStateSnapshot) bool {
	if !n.eng.Apply(snap) {
		return false
	}
	n.mu.Lock()
	n.exposures = snap.GetExposures()
	n.applied = true
	n.mu.Unlock()
	n.save(snap.GetExposures())
	n.refreshAddrs()
	n.converge()
	return true
}

// save replaces the kept ports with the snapshot's, before they are served:
// a crash right after publishing a port still remembers it. A failure is
// logged and tried again with the next snapshot; the ports are served
// either way.
func (n *Node) save(desired []*eitriv1.ExposureDesired) {
	if n.records == nil {
		return
	}
	list := make([]state.Exposure, 0, len(desired))
	for _, e := range desired {
		scope := "lan" // as Spec: anything but "local" listens everywhere
		if e.GetScope() == "local" {
			scope = "local"
		}
		r := state.Exposure{
			ID: e.GetId(), VMID: e.GetVmId(), Protocol: e.GetProtocol(), Scope: scope,
			HostPort: uint16(e.GetHostPort()), GuestPort: uint16(e.GetGuestPort()), MaxSessions: e.GetMaxSessions(),
		}
		list = append(list, r)
	}
	n.saveMu.Lock()
	defer n.saveMu.Unlock()
	if n.saved != nil && slices.Equal(n.saved, list) {
		return
	}
	if err := n.records.SaveExposures(list); err != nil {
		n.log.Error("cannot keep the published ports for a restart", "err", err)
		n.saved = nil
		return
	}
	n.saved = list
}

func (n *Node) converge() {
	n.mu.RLock()
	specs := make([]exposeproxy.Spec, 0, len(n.exposures))
	for _, e := range n.exposures {
		specs = append(specs, Spec(e))
	}
	n.mu.RUnlock()
	n.ports.Converge(specs)
}

// Spec maps a desired exposure to the proxy's terms: "lan" listens on every
// host address, "local" on loopback only.
func Spec(e *eitriv1.ExposureDesired) exposeproxy.Spec {
	addr := netip.IPv4Unspecified()
	if e.GetScope() == "local" {
		addr = netip.AddrFrom4([4]byte{127, 0, 0, 1})
	}
	return exposeproxy.Spec{
		ID: e.GetId(), VMID: e.GetVmId(), Protocol: exposeproxy.Protocol(e.GetProtocol()),
		Listen: netip.AddrPortFrom(addr, uint16(e.GetHostPort())), GuestPort: uint16(e.GetGuestPort()),
		MaxSessions: int(e.GetMaxSessions()),
	}
}

// Fill writes the complete report: VMs from the engine, every exposure with
// its counters (this agent always counts), capacity and metrics.
//
// The engine's part is the one Run built on the engine's last change (the
// engine says every change, and Run rebuilds before it forwards the
// signal), so one change costs one build, however often the sync client
// asks.
func (n *Node) Fill(rep *eitriv1.ActualStateReport) {
	n.mu.RLock()
	e := n.engine
	n.mu.RUnlock()
	if e != nil {
		// Every field the engine's Fill sets; its rows are read-only.
		rep.Vms, rep.Quarantined, rep.Destroyed = e.Vms, e.Quarantined, e.Destroyed
		rep.AppliedGeneration, rep.AppliedEpoch, rep.ControlPlaneId = e.AppliedGeneration, e.AppliedEpoch, e.ControlPlaneId
		rep.SnapshotRefused = e.SnapshotRefused
		rep.Images = e.Images
	} else {
		n.eng.Fill(rep)
	}
	for _, s := range n.ports.Status() {
		rep.Exposures = append(rep.Exposures, &eitriv1.ExposureActual{
			Id: s.ID, State: string(s.State), Reason: s.Reason,
			Sessions: &eitriv1.ExposureSessions{Active: s.Active, Refused: s.Refused, Dropped: s.Dropped,
				Carried: &eitriv1.ExposureBytes{In: s.BytesIn, Out: s.BytesOut}},
		})
	}
	if n.capacity != nil {
		rep.Capacity = n.capacity()
	}
	if n.metrics != nil {
		rep.Metrics = n.metrics()
	}
	if n.accel != nil {
		rep.Accelerator, rep.AcceleratorReason = n.accel()
	}
}
