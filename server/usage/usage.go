// Package usage holds the fleet's recent usage in memory: a bounded window
// of samples per VM and per host, as their hosts pushed them, and the
// watchers that hear each new sample. Nothing here is durable; a control
// plane that restarts starts with empty windows, which fill again within
// seconds.
package usage

import (
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/watch"
)

// DefaultPoints is how many samples a window keeps: an hour at the agent's
// 10 s interval.
const DefaultPoints = 360

// DefaultSpan is how long a series lives without a new sample before it is
// forgotten (a VM deleted, a host gone).
const DefaultSpan = time.Hour

// Event is one new sample, as watchers hear it: Obj is a WatchUsageResponse
// holding a VMUsage or a HostUsage. Owner is the VM's owner ("" for a
// host).
type Event = watch.Event[*eitriv1.WatchUsageResponse]

// Store is safe for concurrent use.
type Store struct {
	points int
	span   time.Duration
	now    func() time.Time
	topic  *watch.Topic[*eitriv1.WatchUsageResponse]

	mu    sync.Mutex
	vms   map[string]*series[*eitriv1.VMUsage]
	hosts map[string]*series[*eitriv1.HostUsage]
}

// New returns an empty store keeping points samples a series (DefaultPoints
// when 0) and forgetting a series silent for span (DefaultSpan when 0).
func New(points int, span time.Duration) *Store {
	if points <= 0 {
		points = DefaultPoints
	}
	if span <= 0 {
		span = DefaultSpan
	}
	return &Store{points: points, span: span, now: time.Now,
		topic: watch.NewTopic[*eitriv1.WatchUsageResponse](),
		vms:   map[string]*series[*eitriv1.VMUsage]{}, hosts: map[string]*series[*eitriv1.HostUsage]{}}
}

// series is one VM's or host's window: a ring of the newest samples.
type series[T proto.Message] struct {
	owner, host string
	ring        []T
	next        int // where the next sample goes once the ring is full
	seen        time.Time
}

func (s *series[T]) add(v T, points int) {
	if len(s.ring) < points {
		s.ring = append(s.ring, v)
		return
	}
	s.ring[s.next] = v
	s.next = (s.next + 1) % points
}

// window returns the samples oldest first.
func (s *series[T]) window() []T {
	out := make([]T, 0, len(s.ring))
	out = append(out, s.ring[s.next:]...)
	return append(out, s.ring[:s.next]...)
}

func (s *series[T]) latest() T {
	return s.ring[(s.next+len(s.ring)-1)%len(s.ring)]
}

// Owner returns the owner and host a VM's series was recorded with, so a
// caller checking who may see a VM need not ask the store again for each
// sample.
func (st *Store) Owner(vmID string) (owner, host string, ok bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	s, ok := st.vms[vmID]
	if !ok {
		return "", "", false
	}
	return s.owner, s.host, true
}

// AddVM records a sample of a VM owned by owner and tells its watchers. u
// must carry its vm_id and host_id and is not changed afterwards.
func (st *Store) AddVM(owner string, u *eitriv1.VMUsage) {
	now := st.now()
	st.mu.Lock()
	s, ok := st.vms[u.GetVmId()]
	if !ok || s.host != u.GetHostId() || s.owner != owner {
		// A VM that moved begins a new series: its counters began again.
		s = &series[*eitriv1.VMUsage]{owner: owner, host: u.GetHostId()}
		st.vms[u.GetVmId()] = s
	}
	s.add(u, st.points)
	s.seen = now
	st.mu.Unlock()
	st.topic.Publish(Event{ID: "vm/" + u.GetVmId(), Owner: owner,
		Obj: &eitriv1.WatchUsageResponse{Event: &eitriv1.WatchUsageResponse_Vm{Vm: u}}})
}

// AddHost records a sample of a host (u carries its host_id) and tells its
// watchers.
func (st *Store) AddHost(u *eitriv1.HostUsage) {
	now := st.now()
	st.mu.Lock()
	s, ok := st.hosts[u.GetHostId()]
	if !ok {
		s = &series[*eitriv1.HostUsage]{host: u.GetHostId()}
		st.hosts[u.GetHostId()] = s
	}
	s.add(u, st.points)
	s.seen = now
	st.mu.Unlock()
	st.topic.Publish(Event{ID: "host/" + u.GetHostId(),
		Obj: &eitriv1.WatchUsageResponse{Event: &eitriv1.WatchUsageResponse_Host{Host: u}}})
}

// Scope is what a watcher is shown.
type Scope struct {
	// VMID: one VM's samples; HostID: one host's. Neither: every host and
	// the VMs Owner allows.
	VMID, HostID string
	// Owner limits VMs to one owner's; "" is everyone's (an admin).
	Owner string
}

func (sc Scope) vm(id, owner string) bool {
	if sc.HostID != "" || (sc.VMID != "" && sc.VMID != id) {
		return false
	}
	return sc.Owner == "" || sc.Owner == owner
}

func (sc Scope) host(id string) bool {
	if sc.VMID != "" {
		return false
	}
	return sc.HostID == "" || sc.HostID == id
}

// Watch subscribes to the samples sc allows and returns the window held
// for them. The subscription is made first, so no sample is missed between
// the two (at worst one arrives both in the window and after it).
func (st *Store) Watch(sc Scope) (*watch.Watcher[*eitriv1.WatchUsageResponse], *eitriv1.UsageWindow) {
	w := st.topic.Subscribe(func(ev Event) bool {
		if v := ev.Obj.GetVm(); v != nil {
			return sc.vm(v.GetVmId(), ev.Owner)
		}
		return sc.host(ev.Obj.GetHost().GetHostId())
	})
	win := &eitriv1.UsageWindow{}
	st.mu.Lock()
	defer st.mu.Unlock()
	st.expireLocked()
	for id, s := range st.vms {
		if sc.vm(id, s.owner) {
			win.Vms = append(win.Vms, s.window()...)
		}
	}
	for id, s := range st.hosts {
		if sc.host(id) {
			win.Hosts = append(win.Hosts, s.window()...)
		}
	}
	return w, win
}

// Watchers is how many watchers are subscribed.
func (st *Store) Watchers() int { return st.topic.Watchers() }

// VMLatest is a VM's newest sample with who owns it.
type VMLatest struct {
	Owner string
	Usage *eitriv1.VMUsage
}

// Latest returns the newest sample of every VM and host still held, for a
// scrape.
func (st *Store) Latest() ([]VMLatest, []*eitriv1.HostUsage) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.expireLocked()
	vms := make([]VMLatest, 0, len(st.vms))
	for _, s := range st.vms {
		vms = append(vms, VMLatest{Owner: s.owner, Usage: s.latest()})
	}
	hosts := make([]*eitriv1.HostUsage, 0, len(st.hosts))
	for _, s := range st.hosts {
		hosts = append(hosts, s.latest())
	}
	return vms, hosts
}

// DropHost forgets the host's series and those of every VM measured on
// it: a decommissioned host's windows go with it.
func (st *Store) DropHost(hostID string) {
	st.mu.Lock()
	defer st.mu.Unlock()
	delete(st.hosts, hostID)
	for id, s := range st.vms {
		if s.host == hostID {
			delete(st.vms, id)
		}
	}
}

// expireLocked forgets series that have been silent for the span.
func (st *Store) expireLocked() {
	cut := st.now().Add(-st.span)
	for id, s := range st.vms {
		if s.seen.Before(cut) {
			delete(st.vms, id)
		}
	}
	for id, s := range st.hosts {
		if s.seen.Before(cut) {
			delete(st.hosts, id)
		}
	}
}
