// Package node is one host as the control plane sees it: the reconcile
// engine's VMs, the published ports, and the host's capacity and load,
// gathered into the complete report the sync client sends, and fed each
// desired snapshot.
package node

import (
	"context"
	"log/slog"
	"net/netip"
	"sync"

	"github.com/a73x/eitri/agent/exposeproxy"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
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

// Node composes one host's report.
type Node struct {
	eng      Engine
	ports    Ports
	capacity func() *eitriv1.Capacity
	metrics  func() *eitriv1.Metrics
	accel    func() (name, reason string)
	log      *slog.Logger

	changed chan struct{}

	mu        sync.RWMutex
	addrs     map[string]netip.Addr // vm id → guest address, for the proxy
	exposures []*eitriv1.ExposureDesired
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
	Log         *slog.Logger
}

// New returns a node; call Run to follow guest address changes.
func New(cfg Config) *Node {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Node{eng: cfg.Engine, ports: cfg.Ports, capacity: cfg.Capacity, metrics: cfg.Metrics, accel: cfg.Accelerator, log: cfg.Log, addrs: map[string]netip.Addr{}, changed: make(chan struct{}, 1)}
}

// Resolve is the exposure proxy's guest-address lookup.
func (n *Node) Resolve(vmID string) (netip.Addr, bool) {
	n.mu.RLock()
	defer n.mu.RUnlock()
	a, ok := n.addrs[vmID]
	return a, ok
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
	var rep eitriv1.ActualStateReport
	n.eng.Fill(&rep)
	next := make(map[string]netip.Addr, len(rep.GetVms()))
	for _, v := range rep.GetVms() {
		// A stopped guest has no address worth dialing, whatever it last had.
		if v.GetPower() != "running" {
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
	n.addrs = next
	return changed
}

// Apply hands a snapshot to the engine and converges the published ports.
func (n *Node) Apply(snap *eitriv1.DesiredStateSnapshot) bool {
	if !n.eng.Apply(snap) {
		return false
	}
	n.mu.Lock()
	n.exposures = snap.GetExposures()
	n.mu.Unlock()
	n.refreshAddrs()
	n.converge()
	return true
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
func (n *Node) Fill(rep *eitriv1.ActualStateReport) {
	n.eng.Fill(rep)
	for _, s := range n.ports.Status() {
		rep.Exposures = append(rep.Exposures, &eitriv1.ExposureActual{
			Id: s.ID, State: string(s.State), Reason: s.Reason,
			Sessions: &eitriv1.ExposureSessions{Active: s.Active, Refused: s.Refused, Dropped: s.Dropped},
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
