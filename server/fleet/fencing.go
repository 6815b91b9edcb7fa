package fleet

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/bounds"
	"github.com/a73x/eitri/wire/vmstate"
)

// Host condition types the agents' fencing raises.
const (
	ConditionSnapshotRefused = "snapshot_refused"
	ConditionOrphanedVMs     = "orphaned_vms"
)

// noteLineage keeps the newest lineage this process has issued or learned.
// f.mu held.
func (f *Fleet) noteLineage(l store.Lineage) {
	cur := f.lineage
	if cur.ID == "" || l.Epoch > cur.Epoch || (l.Epoch == cur.Epoch && l.Generation > cur.Generation) {
		f.lineage = l
	}
}

// fenceForward is told what an agent has applied (from its Hello or a
// report). An agent ahead of this control plane saw writes it no longer
// has: it was restored from an older copy of its database or lost its last
// commits. It then starts a new epoch past the agent, so it never sends a
// generation the agent already saw; the agents hold whatever the lost
// writes would have kept, as orphaned VMs, for an admin.
func (f *Fleet) fenceForward(ctx context.Context, hostID, cpID string, epoch, gen uint64) {
	if epoch == 0 && gen == 0 {
		return
	}
	f.mu.Lock()
	known := f.lineage
	f.mu.Unlock()
	if known.ID == "" {
		l, err := f.st.Lineage(ctx)
		if err != nil {
			f.log.Warn("read the control plane lineage", "err", err)
			return
		}
		f.mu.Lock()
		f.noteLineage(l)
		known = f.lineage
		f.mu.Unlock()
	}
	if cpID != "" && cpID != known.ID {
		// The agent trusts another control plane and refuses this one's
		// snapshots; its refusal (a host condition) says so. Its counters
		// say nothing about ours.
		return
	}
	if epoch <= known.Epoch && gen <= known.Generation {
		return
	}
	l, bumped, err := f.st.FenceForward(ctx, epoch, gen)
	if err != nil {
		f.log.Error("fence forward", "host", hostID, "err", err)
		return
	}
	f.mu.Lock()
	f.noteLineage(l)
	hosts := make([]string, 0, len(f.sessions))
	for id := range f.sessions {
		hosts = append(hosts, id)
	}
	f.mu.Unlock()
	if bumped {
		f.log.Error("this control plane has lost writes its agents saw (restored from an older copy of its database, or its last commits were lost); "+
			"starting a new epoch. Hosts keep VMs this control plane no longer knows of running, as orphaned VMs: adopt or destroy them (eitri vm orphans)",
			"host", hostID, "agent_epoch", epoch, "agent_generation", gen, "epoch", l.Epoch, "generation", l.Generation)
	}
	for _, id := range hosts {
		f.kick(id)
	}
}

// destroyDue says whether a deleted VM's destroy_at has passed by this
// control plane's clock: the one clock that decides.
func destroyDue(v store.VM, now time.Time) bool {
	return v.DeletedAt != nil && v.DestroyAt != nil && !now.Before(*v.DestroyAt)
}

// restorableUntil is when restores of a deleted VM close.
func (f *Fleet) restorableUntil(v store.VM) *time.Time {
	if v.DeletedAt == nil || v.DestroyAt == nil {
		return nil
	}
	t := v.DestroyAt.Add(-f.cfg.RestoreMargin)
	return &t
}

// sweepDestroys sends a fresh snapshot when one of the host's deleted VMs
// has come due since the last one, for as long as the session lasts. The
// last snapshot knows when the next one comes due (every change to a VM's
// desired state sends a new snapshot), so the sweep reads the clock and
// no store: a query per host per sweep was 7% of the control plane at
// 1,000 hosts.
func (s *Session) sweepDestroys() {
	f := s.f
	t := time.NewTicker(f.cfg.DestroySweep)
	defer t.Stop()
	for {
		select {
		case <-s.ctx.Done():
			return
		case <-t.C:
		}
		now := f.now()
		f.mu.Lock()
		due := !s.nextDestroy.IsZero() && !now.Before(s.nextDestroy)
		f.mu.Unlock()
		if due {
			f.kick(s.hostID)
		}
	}
}

// fencingConditions are the host's problems its reports show: it refuses
// this control plane's snapshots, or it holds VMs it will not take this
// control plane's word on.
func (f *Fleet) fencingConditions(hostID string) []*eitriv1.HostCondition {
	live, ok := f.reg.Host(hostID)
	if !ok || live.Report == nil {
		return nil
	}
	var out []*eitriv1.HostCondition
	if r := live.Report.GetSnapshotRefused(); r != nil {
		out = append(out, &eitriv1.HostCondition{
			Type:       ConditionSnapshotRefused,
			Message:    "the agent refuses this control plane's desired state and changes nothing on the host: " + r.GetReason(),
			Since:      timestamppb.New(live.RefusedSince),
			LastSeenAt: timestamppb.New(live.LastSeen),
		})
	}
	if held := live.Report.GetQuarantined(); len(held) > 0 {
		since := live.ConnectedAt
		for _, q := range held {
			if u := q.GetSinceUnix(); u > 0 && time.Unix(u, 0).Before(since) {
				since = time.Unix(u, 0)
			}
		}
		out = append(out, &eitriv1.HostCondition{
			Type: ConditionOrphanedVMs,
			Message: fmt.Sprintf("%d VM(s) on this host are held as they were: this control plane's records of them are missing or older "+
				"than what the host applied. An admin adopts or destroys them (eitri vm orphans).", len(held)),
			Since:      timestamppb.New(since),
			LastSeenAt: timestamppb.New(live.LastSeen),
		})
	}
	return out
}

// ListOrphanedVMs lists the VMs connected hosts hold without trusting this
// control plane's record of them.
func (f *Fleet) ListOrphanedVMs(ctx context.Context) ([]*eitriv1.OrphanedVM, error) {
	if _, err := requireAdmin(ctx); err != nil {
		return nil, err
	}
	hosts, err := f.st.ListHosts(ctx)
	if err != nil {
		return nil, err
	}
	out := []*eitriv1.OrphanedVM{}
	for _, h := range hosts {
		live, ok := f.reg.Host(h.ID)
		if !ok {
			continue
		}
		for _, q := range live.Report.GetQuarantined() {
			out = append(out, f.orphanView(ctx, h.ID, q))
		}
	}
	return out, nil
}

// legacySpec is the spec JSON older agents sent (state.VMSpec's fields).
type legacySpec struct {
	Name, ImageURL, ImageSHA256, SSHAuthorizedKey, Owner string
	VCPUs                                                int32
	MemMB, DiskGB                                        int64
}

// heldOf is what the host holds the VM to; older agents say only their
// spec JSON.
func heldOf(q *eitriv1.QuarantinedVM) *eitriv1.VMDesired {
	if h := q.GetHeld(); h != nil {
		return h
	}
	var s legacySpec
	if json.Unmarshal(q.GetVmspecJson(), &s) != nil {
		return &eitriv1.VMDesired{VmId: q.GetVmId(), Name: q.GetName()}
	}
	return &eitriv1.VMDesired{VmId: q.GetVmId(), Name: cmp.Or(s.Name, q.GetName()), ImageUrl: s.ImageURL, ImageSha256: s.ImageSHA256,
		Vcpus: s.VCPUs, MemMb: s.MemMB, DiskGb: s.DiskGB, SshAuthorizedKey: s.SSHAuthorizedKey, Owner: s.Owner}
}

func (f *Fleet) orphanView(ctx context.Context, hostID string, q *eitriv1.QuarantinedVM) *eitriv1.OrphanedVM {
	h := heldOf(q)
	o := &eitriv1.OrphanedVM{
		HostId: hostID, VmId: q.GetVmId(), Name: cmp.Or(h.GetName(), q.GetName()), OwnerId: h.GetOwner(),
		ImageUrl: h.GetImageUrl(), ImageSha256: h.GetImageSha256(), Vcpus: h.GetVcpus(), MemMb: h.GetMemMb(), DiskGb: h.GetDiskGb(),
		SshAuthorizedKey: h.GetSshAuthorizedKey(), PowerState: h.GetPowerState(), ActualPower: q.GetPower(), Deleted: h.GetDeleted(),
		Reason: q.GetReason(),
	}
	if u := q.GetSinceUnix(); u > 0 {
		o.Since = timestamppb.New(time.Unix(u, 0))
	}
	if o.OwnerId != "" {
		if u, err := f.st.UserByID(ctx, o.OwnerId); err == nil {
			o.OwnerName = u.Name
		}
	}
	if v, err := f.st.GetVM(ctx, q.GetVmId()); err == nil && v.HostID == hostID {
		o.HasRow = true
	}
	return o
}

// findOrphan is the VM hostID reports holding as vmID.
func (f *Fleet) findOrphan(hostID, vmID string) (*eitriv1.QuarantinedVM, error) {
	switch {
	case hostID == "":
		return nil, invalid("host_id", "required")
	case vmID == "":
		return nil, invalid("vm_id", "required")
	}
	if err := checkLen("host_id", hostID, bounds.MaxIDLen); err != nil {
		return nil, err
	}
	if err := checkLen("vm_id", vmID, bounds.MaxIDLen); err != nil {
		return nil, err
	}
	live, ok := f.reg.Host(hostID)
	if !ok || live.Report == nil {
		return nil, errorf(Precondition, "host %s is not connected; only a connected host can say what it holds", hostID)
	}
	for _, q := range live.Report.GetQuarantined() {
		if q.GetVmId() == vmID {
			return q, nil
		}
	}
	return nil, errorf(NotFound, "host %s holds no orphaned vm %s", hostID, vmID)
}

// AdoptOrphanedVM takes back a VM its host holds: the row is restored (or
// re-issued) with the same id, so the host keeps the same disk, and with
// the spec, owner, power and delete the host holds it to. Quota and room
// are not checked: the VM already runs there, and refusing would not free
// anything.
func (f *Fleet) AdoptOrphanedVM(ctx context.Context, r *eitriv1.AdoptOrphanedVMRequest) (*eitriv1.VM, error) {
	if _, err := requireAdmin(ctx); err != nil {
		return nil, err
	}
	q, err := f.findOrphan(r.GetHostId(), r.GetVmId())
	if err != nil {
		return nil, err
	}
	held := heldOf(q)
	if q.GetHeld() == nil {
		return nil, errorf(Precondition, "host %s's agent does not say what it holds vm %s to (an older agent); upgrade it first", r.GetHostId(), r.GetVmId())
	}
	owner := cmp.Or(r.GetOwnerId(), held.GetOwner())
	if err := checkLen("owner_id", owner, bounds.MaxIDLen); err != nil {
		return nil, err
	}
	if _, err := f.st.UserByID(ctx, owner); errors.Is(err, store.ErrNotFound) || owner == "" {
		return nil, errorf(Precondition, "its owner %q is not known to this control plane; pass owner_id to give it to a user", owner)
	} else if err != nil {
		return nil, err
	}
	name := cmp.Or(r.GetName(), held.GetName())
	if why := vmNameProblem(name); why != "" {
		if r.GetName() == "" {
			why += " (the name its host holds; pass name to adopt it under another)"
		}
		return nil, invalid("name", "%s", why)
	}
	power := held.GetPowerState()
	if power != vmstate.PowerRunning && power != vmstate.PowerStopped {
		power = vmstate.PowerRunning
	}
	now := f.now()
	adopt := func(v *store.VM) {
		v.OwnerID, v.Name, v.PowerState = owner, name, power
		v.ImageURL, v.ImageSHA256 = held.GetImageUrl(), held.GetImageSha256()
		v.VCPUs, v.MemMB, v.DiskGB = held.GetVcpus(), held.GetMemMb(), held.GetDiskGb()
		v.SSHAuthorizedKey = held.GetSshAuthorizedKey()
		if held.GetDeleted() {
			// It comes back deleted, with a whole grace: nobody has had
			// the chance to restore it from here.
			at := now.Add(f.cfg.DeleteGrace)
			v.DeletedAt, v.DestroyAt = &now, &at
		} else {
			v.DeletedAt, v.DestroyAt = nil, nil
		}
	}
	id := r.GetVmId()
	vm, err := f.st.GetVM(ctx, id)
	switch {
	case err == nil:
		if vm.HostID != r.GetHostId() {
			return nil, errorf(Precondition, "vm %s is placed on host %s here, not on %s", id, vm.HostID, r.GetHostId())
		}
		vm, err = f.st.ReassertVM(ctx, id, func(v *store.VM) error { adopt(v); return nil })
	case errors.Is(err, store.ErrNotFound):
		vm = store.VM{ID: id, HostID: r.GetHostId(), Status: vmstate.LifecyclePending, CreatedAt: now, UpdatedAt: now}
		adopt(&vm)
		vm, err = f.st.CreateVM(ctx, vm)
	}
	if errors.Is(err, store.ErrConflict) {
		return nil, errorf(Conflict, "name: its owner already has a VM named %q; pass name to adopt it under another", name)
	}
	if err != nil {
		return nil, storeErr(err, "vm "+id)
	}
	f.event(ctx, id, "adopted", fmt.Sprintf("adopted as host %s held it (%s)", f.hostName(ctx, r.GetHostId()), q.GetReason()))
	f.log.Info("orphaned vm adopted", "vm", id, "host", r.GetHostId())
	f.vmWritten(vm)
	f.exposuresOfVMChanged(ctx, id)
	return f.vmView(vm), nil
}

// DestroyOrphanedVM orders the host to destroy a VM it holds: the row (or,
// if this control plane has none, a new one for the purpose) is deleted
// with destroy_at now, so the next snapshot says destroy, and the row goes
// once the host reports it destroyed.
func (f *Fleet) DestroyOrphanedVM(ctx context.Context, r *eitriv1.DestroyOrphanedVMRequest) error {
	p, err := requireAdmin(ctx)
	if err != nil {
		return err
	}
	q, err := f.findOrphan(r.GetHostId(), r.GetVmId())
	if err != nil {
		return err
	}
	id := r.GetVmId()
	now := f.now()
	doom := func(v *store.VM) {
		if v.DeletedAt == nil {
			v.DeletedAt = &now
		}
		v.DestroyAt = &now
	}
	vm, err := f.st.GetVM(ctx, id)
	switch {
	case err == nil:
		if vm.HostID != r.GetHostId() {
			return errorf(Precondition, "vm %s is placed on host %s here, not on %s", id, vm.HostID, r.GetHostId())
		}
		vm, err = f.st.ReassertVM(ctx, id, func(v *store.VM) error { doom(v); return nil })
	case errors.Is(err, store.ErrNotFound):
		held := heldOf(q)
		owner := held.GetOwner()
		if _, uerr := f.st.UserByID(ctx, owner); uerr != nil {
			owner = p.UserID // a row needs a known owner; it lives only until the host reports the destroy
		}
		vm = store.VM{ID: id, OwnerID: owner, HostID: r.GetHostId(), Name: cmp.Or(held.GetName(), id),
			ImageURL: held.GetImageUrl(), ImageSHA256: held.GetImageSha256(), VCPUs: held.GetVcpus(), MemMB: held.GetMemMb(), DiskGB: held.GetDiskGb(),
			PowerState: vmstate.PowerStopped, Status: vmstate.LifecyclePending, CreatedAt: now, UpdatedAt: now}
		doom(&vm)
		row, cerr := f.st.CreateVM(ctx, vm)
		if errors.Is(cerr, store.ErrConflict) {
			vm.Name = id // the owner reused the name; the row is only a destroy order
			row, cerr = f.st.CreateVM(ctx, vm)
		}
		vm, err = row, cerr
	}
	if err != nil {
		return storeErr(err, "vm "+id)
	}
	f.event(ctx, id, "deleted", fmt.Sprintf("orphaned on host %s (%s); destroy ordered by %s", f.hostName(ctx, r.GetHostId()), q.GetReason(), p.Name))
	f.log.Info("orphaned vm destroy ordered", "vm", id, "host", r.GetHostId(), "by", p.Name)
	f.vmWritten(vm)
	f.exposuresOfVMChanged(ctx, id)
	return nil
}

func (f *Fleet) hostName(ctx context.Context, id string) string {
	if h, err := f.st.HostByID(ctx, id); err == nil {
		return h.Name
	}
	return id
}
