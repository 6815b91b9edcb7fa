package fleet

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/registry"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/vmstate"
)

// ErrReplaced ends a stream that a newer stream from the same host replaced.
var ErrReplaced = errors.New("replaced by a newer stream from the same host")

// Session is one host's agent stream as the fleet sees it.
type Session struct {
	f        *Fleet
	hostID   string
	conn     uint64
	instance string // the agent process's random id; empty from older agents
	// claim is the stream's conn number in the fleet-wide claim on its
	// host (host_live); 0 on SQLite.
	claim  int64
	peer   string
	since  time.Time
	ctx    context.Context
	cancel context.CancelCauseFunc
	kicks  chan struct{}
	// nextDestroy: the earliest destroy_at the last snapshot did not yet
	// order, zero when none (f.mu). The sweep compares the clock with it.
	nextDestroy time.Time
	// offered names the upgrade offer the last snapshot carried ("" for
	// none), and upgrade what the agent last said of its upgrade (f.mu).
	offered string
	upgrade store.HostUpgrade
	// images is the host's last word on its image cache on this stream, and
	// when it came (f.mu); nil until it says (see hostimages.go).
	images   *eitriv1.ImageCacheReport
	imagesAt time.Time
}

// OpenSession registers a host's new stream and queues the snapshot every
// (re)connect gets. A stream from the agent process that owns the open one
// (a reconnect the old stream has not noticed yet) replaces it; a stream from
// another process with the same identity is refused with a Precondition
// error that says what to do, and the open stream is kept: flapping between
// two agents would let both of them act on the host's desired state.
func (f *Fleet) OpenSession(ctx context.Context, hostID string, hello *eitriv1.Hello, peer string) (*Session, error) {
	cleanFromHost(hello)
	now := f.now()
	if err := f.refuseDuplicate(ctx, hostID, hello, peer, now); err != nil {
		return nil, err
	}
	// With replicas: one stream per host in the whole fleet.
	claim, err := f.claimHost(ctx, hostID, hello, peer)
	if err != nil {
		return nil, err
	}
	// Before the first snapshot goes out: an agent ahead of this control
	// plane must never be sent a generation it already saw.
	f.fenceForward(ctx, hostID, hello.GetControlPlaneId(), hello.GetAppliedEpoch(), hello.GetAppliedGeneration())
	if err := f.st.UpdateHostHello(ctx, hostID, store.HostHello{
		AgentVersion: hello.GetAgentVersion(), Address: hello.GetAddress(),
		Accelerator: hello.GetAccelerator(), AcceleratorReason: hello.GetAcceleratorReason(),
		OS: hello.GetOs(), Arch: hello.GetArch(),
	}, now); err != nil {
		f.log.Warn("record host hello", "host", hostID, "err", err)
	}
	// A host back on a new version may finish its part in a rollout.
	f.wakeRollouts()
	sctx, cancel := context.WithCancelCause(ctx)
	s := &Session{f: f, hostID: hostID, instance: hello.GetInstanceId(), claim: claim, peer: peer, since: now,
		ctx: sctx, cancel: cancel, kicks: make(chan struct{}, 1)}
	s.kicks <- struct{}{}

	f.mu.Lock()
	if old := f.sessions[hostID]; old != nil {
		old.cancel(ErrReplaced)
	}
	var d registry.Diff
	s.conn, d = f.reg.Connect(hostID, hello, now)
	f.sessions[hostID] = s
	f.mu.Unlock()

	f.log.Info("host connected", "host", hostID, "agent_version", hello.GetAgentVersion(), "peer", peer)
	f.publishDiff(ctx, hostID, d)
	go s.sweepDestroys()
	return s, nil
}

// Context ends when the session is replaced or its host decommissioned.
func (s *Session) Context() context.Context { return s.ctx }

// Kicks signals that the host's desired state changed (coalesced).
func (s *Session) Kicks() <-chan struct{} { return s.kicks }

// Close forgets the stream's live state, unless a newer stream owns it.
func (s *Session) Close() {
	f := s.f
	f.mu.Lock()
	if f.sessions[s.hostID] == s {
		delete(f.sessions, s.hostID)
	}
	d, ok := f.reg.Disconnect(s.hostID, s.conn)
	f.mu.Unlock()
	s.cancel(context.Canceled)
	f.releaseHost(context.WithoutCancel(s.ctx), s)
	if ok {
		ctx := context.WithoutCancel(s.ctx)
		_ = f.st.TouchHost(ctx, s.hostID, f.now())
		f.log.Info("host disconnected", "host", s.hostID)
		f.publishDiff(ctx, s.hostID, d)
	}
}

func (f *Fleet) kick(hostID string) {
	f.mu.Lock()
	s := f.sessions[hostID]
	f.mu.Unlock()
	if s == nil {
		return
	}
	select {
	case s.kicks <- struct{}{}:
	default:
	}
}

// Snapshot builds the host's complete desired state with a fresh generation
// from the stored counter, so it rises across restarts and clock steps
// alike. Each VM carries the version of its desired state, and the destroy
// of a deleted VM once this control plane's clock has passed its
// destroy_at: the agent's clock never decides it.
func (s *Session) Snapshot(ctx context.Context) (*eitriv1.DesiredStateSnapshot, error) {
	f := s.f
	if s.claim != 0 {
		// Fenced by the claim: a replica that lost the host (frozen past
		// its claim, or the agent moved) sends it nothing more.
		held, err := f.st.HoldsHost(ctx, s.hostID, s.claim)
		if err != nil {
			return nil, err
		}
		if !held {
			s.cancel(ErrReplaced)
			return nil, ErrReplaced
		}
	}
	vms, err := f.st.ListVMsByHost(ctx, s.hostID)
	if err != nil {
		return nil, err
	}
	exps, err := f.st.ListExposuresByHost(ctx, s.hostID)
	if err != nil {
		return nil, err
	}
	snap := &eitriv1.DesiredStateSnapshot{}
	deleted := map[string]bool{}
	var next time.Time
	now := f.now()
	userCAs := f.trustedUserCAKeys()
	for _, v := range vms {
		d := &eitriv1.VMDesired{
			VmId: v.ID, Name: v.Name, ImageUrl: v.ImageURL, ImageSha256: v.ImageSHA256,
			Vcpus: v.VCPUs, MemMb: v.MemMB, DiskGb: v.DiskGB, PowerState: v.PowerState,
			SshAuthorizedKey: v.SSHAuthorizedKey, Owner: v.OwnerID, Version: v.DesiredGen,
			Retry: v.Retry, SshUserCaKeys: userCAs, Readiness: readinessOf(v.Readiness),
		}
		if len(v.UserCAKeys) > 0 {
			// The keys recorded for the VM are the ones its seed gets, so
			// what the VM shows it trusts is what the guest was given.
			d.SshUserCaKeys = v.UserCAKeys
		}
		if v.DeletedAt != nil {
			d.Deleted = true
			deleted[v.ID] = true
			if v.DestroyAt != nil {
				d.DestroyAtUnix = v.DestroyAt.Unix()
				d.Destroy = destroyDue(v, now)
				if !d.Destroy && (next.IsZero() || v.DestroyAt.Before(next)) {
					next = *v.DestroyAt
				}
			}
		}
		snap.Vms = append(snap.Vms, d)
	}
	// Exposures follow their VM: a deleted VM's ports close with it.
	for _, e := range exps {
		if deleted[e.VMID] {
			continue
		}
		snap.Exposures = append(snap.Exposures, &eitriv1.ExposureDesired{
			Id: e.ID, VmId: e.VMID, GuestPort: uint32(e.GuestPort), HostPort: uint32(e.HostPort),
			Protocol: e.Protocol, Scope: e.Scope, MaxSessions: e.MaxSessions,
		})
	}
	offer, offered, err := f.upgradeOffer(ctx, s.hostID)
	if err != nil {
		return nil, err
	}
	snap.AgentUpgrade = offer
	if snap.Images, err = f.wantedImages(ctx, s.hostID); err != nil {
		return nil, err
	}
	l, err := f.st.NextGeneration(ctx)
	if err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.noteLineage(l)
	s.nextDestroy = next
	s.offered = offered
	f.mu.Unlock()
	snap.ControlPlaneId, snap.Epoch, snap.Generation = l.ID, l.Epoch, l.Generation
	return snap, nil
}

// Apply takes one complete report from the host.
func (s *Session) Apply(ctx context.Context, rep *eitriv1.ActualStateReport) {
	clipReport(rep)
	f := s.f
	now := f.now()
	d, ok := f.reg.Apply(s.hostID, s.conn, rep, now)
	if !ok {
		return
	}
	f.fenceForward(ctx, s.hostID, rep.GetControlPlaneId(), rep.GetAppliedEpoch(), rep.GetAppliedGeneration())
	if d.Refusal {
		if r := rep.GetSnapshotRefused(); r != nil {
			f.log.Error("the host refuses this control plane's desired state", "host", s.hostID, "reason", r.GetReason())
		} else {
			f.log.Info("the host applies this control plane's desired state again", "host", s.hostID)
		}
	}
	if d.Accelerator {
		// A re-probe changed what new guests run under; a disconnected host
		// keeps showing the last word.
		if err := f.st.UpdateHostAccelerator(ctx, s.hostID, rep.GetAccelerator(), rep.GetAcceleratorReason()); err != nil {
			f.log.Warn("record host accelerator", "host", s.hostID, "err", err)
		}
	}
	// What people need after the host goes away (its last status, address,
	// error and host key) is kept durably; narration and counters are not,
	// so a report that only narrates costs no store transaction.
	written := map[string]store.VM{}
	for _, id := range d.Durable {
		row, _ := f.reg.VM(s.hostID, id)
		if row == nil {
			continue
		}
		if vm, ok := f.persistRow(ctx, s.hostID, row); ok {
			written[id] = vm
		}
	}
	for _, id := range rep.GetDestroyed() {
		f.forgetDestroyed(ctx, s.hostID, id)
		delete(written, id)
	}
	f.publishWritten(ctx, s.hostID, d, written)
	f.shareReport(s)
	s.noteUpgrade(ctx, rep.GetUpgrade())

	f.mu.Lock()
	last := f.touched[s.hostID]
	stale := now.Sub(last) > 30*time.Second
	if stale {
		f.touched[s.hostID] = now
	}
	f.mu.Unlock()
	if stale {
		_ = f.st.TouchHost(ctx, s.hostID, now)
	}
}

// absorb folds a host's report row into the durable fields it speaks for:
// the last settled status, its error, the address and the host key. The
// store and the view both use it, so a VM read between the report and its
// store write shows what the write will hold.
func absorb(v *store.VM, row *eitriv1.ActualVM) {
	switch ph := row.GetPhase(); ph {
	case vmstate.PhaseCreating, vmstate.PhaseReady, vmstate.PhaseStopped, vmstate.PhaseFailed:
		if ph == vmstate.PhaseFailed && row.GetRetry() < v.Retry {
			break // sent before the host saw the retry; the next report answers it
		}
		v.Status = ph
		if ph == vmstate.PhaseFailed {
			v.LastError = row.GetLastError()
		} else if ph == vmstate.PhaseReady {
			v.LastError = ""
		}
	}
	if ip := row.GetIp(); ip != "" {
		v.AssignedIP = ip
	}
	if k := row.GetSshHostPubkey(); k != "" {
		v.SSHHostPubkey = k
	}
}

// persistRow writes what a report row says of a VM's durable fields, and
// returns the row as written (ok false when there was none to write).
func (f *Fleet) persistRow(ctx context.Context, hostID string, row *eitriv1.ActualVM) (written store.VM, ok bool) {
	var from, to string
	var exits uint64 // unexpected exits not yet recorded as events
	written, changed, err := f.st.UpdateVM(ctx, row.GetVmId(), func(v *store.VM) error {
		if v.HostID != hostID {
			return errNotMine
		}
		from = v.Status
		absorb(v, row)
		// The host's count only rises; a resent report finds it recorded.
		if n := uint64(row.GetUnexpectedExits()); n != v.ExitsSeen {
			if n > v.ExitsSeen && row.GetLastExit() != nil {
				exits = n - v.ExitsSeen
			}
			v.ExitsSeen = n
		}
		to = v.Status
		return nil
	})
	if err != nil {
		if !errors.Is(err, errNotMine) && !errors.Is(err, store.ErrNotFound) {
			f.log.Warn("persist reported vm", "vm", row.GetVmId(), "err", err)
		}
		return store.VM{}, false
	}
	if exits > 0 {
		f.event(ctx, row.GetVmId(), "exited", exitWords(row.GetLastExit(), exits))
	}
	if changed && from != to {
		msg := fmt.Sprintf("%s → %s", from, to)
		if to == vmstate.PhaseReady && row.GetIp() != "" {
			msg += " at " + row.GetIp()
		}
		if to == vmstate.PhaseFailed && row.GetLastError() != "" {
			msg += ": " + row.GetLastError()
		}
		f.event(ctx, row.GetVmId(), "status", msg)
	}
	return written, true
}

// exitWords is the event for a guest that ended unasked: how, and what its
// serial console said last. n > 1 when the host counted exits this control
// plane never heard of (it was away); only the latest is described.
func exitWords(e *eitriv1.GuestExit, n uint64) string {
	msg := e.GetReason()
	if msg == "" {
		msg = "the guest ended unasked"
	}
	if n > 1 {
		msg += fmt.Sprintf(" (the latest of %d exits since the last one recorded)", n)
	}
	if tail := strings.TrimSpace(e.GetSerialTail()); tail != "" {
		return msg + "; serial console:\n" + tail
	}
	return msg + "; the serial console was empty"
}

var errNotMine = errors.New("vm belongs to another host")

// forgetDestroyed drops a VM its host has destroyed for good — only one that
// was deleted and placed there, so a confused agent cannot erase a VM
// anybody still wants.
func (f *Fleet) forgetDestroyed(ctx context.Context, hostID, id string) {
	vm, err := f.st.GetVM(ctx, id)
	if err != nil || vm.HostID != hostID || vm.DeletedAt == nil {
		return
	}
	exps, _ := f.st.ListExposures(ctx, id)
	if err := f.st.DeleteVM(ctx, id); err != nil {
		f.log.Warn("forget destroyed vm", "vm", id, "err", err)
		return
	}
	f.log.Info("vm destroyed", "vm", id, "host", hostID)
	for _, e := range exps {
		f.exposureRemoved(e, vm.OwnerID)
	}
	f.vmRemoved(id, vm.OwnerID)
	f.publishHost(ctx, hostID)
	f.kick(hostID)
}

func (f *Fleet) publishDiff(ctx context.Context, hostID string, d registry.Diff) {
	f.publishWritten(ctx, hostID, d, nil)
}

// publishWritten is publishDiff for a report whose durable rows were just
// written: those are published as written, not read back by id.
func (f *Fleet) publishWritten(ctx context.Context, hostID string, d registry.Diff, written map[string]store.VM) {
	durable := make(map[string]bool, len(d.Durable))
	for _, id := range d.Durable {
		durable[id] = true
	}
	for _, id := range d.VMs {
		if vm, ok := written[id]; ok {
			f.publishVMRow(vm)
		} else if durable[id] {
			// Not written here just now (another replica's host, a write
			// that failed or found the row gone): the store has the truth.
			f.publishVM(ctx, id)
		} else {
			f.publishLiveVM(ctx, id)
		}
	}
	for _, id := range d.Exposures {
		f.publishLiveExposure(ctx, id)
	}
	if d.Host {
		f.publishHost(ctx, hostID)
	}
	if d.Images {
		f.publishHostImages(ctx, hostID)
	}
}
