package main

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// simHost is one simulated agent's state: what the control plane asked for
// (VM ids and exposures from the snapshots) and what it reports on them. It
// is a syncclient.Source, so the real stream code carries its reports.
type simHost struct {
	id      string
	home    int // the replica its stream goes to
	tracks  *tracks
	changed chan struct{}
	reports *atomic.Int64

	mu        sync.Mutex
	vms       []string // sorted
	exps      []string
	detail    map[string]string // vm id → status_detail
	active    map[string]int64  // exposure id → sessions.active
	seq       uint64
	cpID      string
	epoch     uint64
	gen       uint64
	unstamped []stamp // changes made but not yet in a report
}

type stamp struct {
	kind, obj string
	seq       uint64
}

func newSimHost(id string, home int, t *tracks, reports *atomic.Int64) *simHost {
	return &simHost{id: id, home: home, tracks: t, reports: reports, changed: make(chan struct{}, 1),
		detail: map[string]string{}, active: map[string]int64{}}
}

func (h *simHost) Apply(s *eitriv1.DesiredStateSnapshot) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.vms = h.vms[:0]
	for _, v := range s.GetVms() {
		if !v.GetDeleted() {
			h.vms = append(h.vms, v.GetVmId())
		}
	}
	slices.Sort(h.vms)
	h.exps = h.exps[:0]
	for _, e := range s.GetExposures() {
		h.exps = append(h.exps, e.GetId())
	}
	h.cpID, h.epoch, h.gen = s.GetControlPlaneId(), s.GetEpoch(), s.GetGeneration()
	return true
}

func (h *simHost) Changed() <-chan struct{} { return h.changed }

// Fill is the complete report, as a real agent's: every VM running, every
// exposure active with its counters, capacity and metrics.
func (h *simHost) Fill(rep *eitriv1.ActualStateReport) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for i, id := range h.vms {
		rep.Vms = append(rep.Vms, &eitriv1.ActualVM{
			VmId: id, Power: "running", Phase: "ready",
			Ip: fmt.Sprintf("10.0.%d.%d", i/250, i%250+2), StatusDetail: h.detail[id],
		})
	}
	for _, id := range h.exps {
		rep.Exposures = append(rep.Exposures, &eitriv1.ExposureActual{Id: id, State: "active",
			Sessions: &eitriv1.ExposureSessions{Active: h.active[id]}})
	}
	rep.Capacity = &eitriv1.Capacity{Vcpus: 100000, MemMb: 1 << 30, DiskGb: 1 << 30}
	rep.Metrics = &eitriv1.Metrics{MemTotalMb: 1 << 20, MemAvailableMb: 1 << 19}
	rep.ControlPlaneId, rep.AppliedEpoch, rep.AppliedGeneration = h.cpID, h.epoch, h.gen
	rep.Accelerator = "tcg"
	if len(h.unstamped) > 0 {
		// The change leaves now: its clock starts here.
		now := time.Now()
		for _, s := range h.unstamped {
			h.tracks.sent(s.kind, s.obj, s.seq, now, h.home)
		}
		h.unstamped = h.unstamped[:0]
		h.reports.Add(1)
	}
}

// step is one narration beat: the next VM in turn says how its download
// goes, and the first exposure's session counter moves.
func (h *simHost) step() {
	h.mu.Lock()
	if len(h.vms) == 0 {
		h.mu.Unlock()
		return
	}
	h.seq++
	vm := h.vms[int(h.seq)%len(h.vms)]
	h.detail[vm] = fmt.Sprintf("downloading image … %d%% (#%d)", h.seq%100, h.seq)
	h.unstamped = append(h.unstamped, stamp{"vms", vm, h.seq})
	if len(h.exps) > 0 {
		h.active[h.exps[0]] = int64(h.seq)
		h.unstamped = append(h.unstamped, stamp{"exposures", h.exps[0], h.seq})
	}
	h.mu.Unlock()
	select {
	case h.changed <- struct{}{}:
	default:
	}
}

func (h *simHost) ready(vms, exps int) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.vms) >= vms && len(h.exps) >= exps
}
