package fleet

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/bounds"
	"github.com/a73x/eitri/wire/sshcert"
	"github.com/a73x/eitri/wire/vmstate"
)

var (
	dnsLabel = regexp.MustCompile(`^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$`)
	sha256Re = regexp.MustCompile(`^[0-9a-f]{64}$`)
)

// checkLen refuses a value longer than max bytes, without echoing it.
func checkLen(field, v string, max int) error {
	if len(v) > max {
		return invalid(field, "at most %d bytes, got %d", max, len(v))
	}
	return nil
}

// vmNameProblem says what is wrong with a VM name ("" for nothing): it
// must be a DNS label that cannot be taken for a name eitri gives out: a
// VM's id ("vm-..."), a host alias ("eitri-...", which `eitri ssh`
// connects by and host certificates name), or "localhost". Whoever names
// a VM is root in it; a name shaped like another VM's id or alias is a
// claim on that VM's identity.
func vmNameProblem(name string) string {
	switch {
	case !dnsLabel.MatchString(name):
		return fmt.Sprintf("%q is not a DNS label (lowercase letters, digits and '-', 1-63 characters, no leading or trailing '-')", name)
	case strings.HasPrefix(name, "vm-"):
		return fmt.Sprintf("%q starts with \"vm-\", which VM ids do; choose another name", name)
	case strings.HasPrefix(name, sshcert.AliasPrefix):
		return fmt.Sprintf("%q starts with %q, which eitri's host aliases do; choose another name", name, sshcert.AliasPrefix)
	case name == "localhost":
		return fmt.Sprintf("%q names every machine to itself; choose another name", name)
	}
	return ""
}

func validateVM(r *eitriv1.CreateVMRequest) error {
	for _, c := range []struct {
		field, v string
		max      int
	}{
		{"name", r.GetName(), bounds.MaxNameLen},
		{"host_id", r.GetHostId(), bounds.MaxIDLen},
		{"image", r.GetImage(), bounds.MaxNameLen},
		{"image_url", r.GetImageUrl(), bounds.MaxURLLen},
		{"image_sha256", r.GetImageSha256(), 64},
		{"ssh_authorized_key", r.GetSshAuthorizedKey(), bounds.MaxSSHKeyLen},
		{"power_state", r.GetPowerState(), len(vmstate.PowerRunning)},
	} {
		if err := checkLen(c.field, c.v, c.max); err != nil {
			return err
		}
	}
	if why := vmNameProblem(r.GetName()); why != "" {
		return invalid("name", "%s", why)
	}
	if r.GetImage() != "" {
		switch {
		case r.GetImageUrl() != "":
			return invalid("image_url", "give either image (a catalogue name) or image_url with image_sha256, not both")
		case r.GetImageSha256() != "":
			return invalid("image_sha256", "give either image (a catalogue name) or image_url with image_sha256, not both")
		}
	} else {
		if r.GetImageUrl() == "" {
			return invalid("image_url", "required (or image, a catalogue name)")
		}
		u, err := url.Parse(r.GetImageUrl())
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return invalid("image_url", "%q is not an http(s) URL", r.GetImageUrl())
		}
		if !sha256Re.MatchString(r.GetImageSha256()) {
			return invalid("image_sha256", "must be 64 lowercase hex characters")
		}
	}
	switch {
	case r.GetVcpus() < bounds.MinVCPUs || r.GetVcpus() > bounds.MaxVCPUs:
		return invalid("vcpus", "must be between %d and %d, got %d", bounds.MinVCPUs, bounds.MaxVCPUs, r.GetVcpus())
	case r.GetMemMb() < bounds.MinMemMB || r.GetMemMb() > bounds.MaxMemMB:
		return invalid("mem_mb", "must be between %d and %d, got %d", bounds.MinMemMB, bounds.MaxMemMB, r.GetMemMb())
	case r.GetDiskGb() < bounds.MinDiskGB || r.GetDiskGb() > bounds.MaxDiskGB:
		return invalid("disk_gb", "must be between %d and %d, got %d", bounds.MinDiskGB, bounds.MaxDiskGB, r.GetDiskGb())
	}
	switch r.GetPowerState() {
	case "", vmstate.PowerRunning, vmstate.PowerStopped:
	default:
		return invalid("power_state", "must be %q or %q, got %q", vmstate.PowerRunning, vmstate.PowerStopped, r.GetPowerState())
	}
	for _, c := range r.GetSshAuthorizedKey() {
		if c == '\n' || c == '\r' {
			return invalid("ssh_authorized_key", "must be a single line")
		}
	}
	return nil
}

// CreateVM validates, places and records a VM, then tells its host.
func (f *Fleet) CreateVM(ctx context.Context, r *eitriv1.CreateVMRequest) (*eitriv1.VM, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	if err := validateVM(r); err != nil {
		return nil, err
	}
	var img store.Image
	var ver store.ImageVersion
	if r.GetImage() != "" {
		if img, ver, err = f.imageForCreate(ctx, r); err != nil {
			return nil, err
		}
	}
	f.quota.admit.Lock()
	defer f.quota.admit.Unlock()
	need := Usage{VMs: 1, VCPUs: int64(r.GetVcpus()), MemMB: r.GetMemMb(), DiskGB: r.GetDiskGb()}
	if err := f.admitQuota(ctx, f.st, p, need); err != nil {
		return nil, err
	}
	hostID, err := f.place(ctx, r)
	if err != nil {
		return nil, err
	}
	power := r.GetPowerState()
	if power == "" {
		power = vmstate.PowerRunning
	}
	now := f.now()
	vm := store.VM{
		ID: newID("vm"), OwnerID: p.UserID, HostID: hostID, Name: r.GetName(),
		ImageURL: r.GetImageUrl(), ImageSHA256: r.GetImageSha256(),
		VCPUs: r.GetVcpus(), MemMB: r.GetMemMb(), DiskGB: r.GetDiskGb(),
		PowerState: power, Status: vmstate.LifecyclePending, SSHAuthorizedKey: r.GetSshAuthorizedKey(),
		CreatedAt: now, UpdatedAt: now,
		// What its seed will trust, kept so a later rotation can show the
		// guest left behind (snapshots send the VM these keys).
		UserCAKeys: f.trustedUserCAKeys(),
	}
	if r.GetImage() != "" {
		vm.ImageURL, vm.ImageSHA256 = ver.URL, ver.SHA256
		vm.ImageName, vm.ImageVersion, vm.Readiness = img.Name, ver.Version, img.Readiness
	}
	// The checks above, again inside the insert's transaction: with other
	// replicas on the same database, f.quota.admit does not stop them
	// taking the last slot in between, and the transaction does. On
	// SQLite this process is the only writer and f.quota.admit is held
	// from the checks to the insert, so they still hold: checking twice
	// would only double the reads every create makes under that lock.
	var admit func(ctx context.Context, rd store.Reader) error
	if f.st.Shared() {
		admit = func(ctx context.Context, rd store.Reader) error {
			if err := f.admitQuota(ctx, rd, p, need); err != nil {
				return err
			}
			if _, why := f.room(ctx, rd, hostID, need.VCPUs, need.MemMB, need.DiskGB); why != "" {
				return errorf(Precondition, "host %s %s", hostID, why)
			}
			return nil
		}
	}
	written, err := f.st.CreateVMAdmitted(ctx, vm, admit)
	if err != nil {
		if errors.Is(err, store.ErrConflict) {
			return nil, errorf(Conflict, "name: you already have a VM named %q", vm.Name)
		}
		return nil, err
	}
	vm = written
	where := hostID
	if h, err := f.st.HostByID(ctx, hostID); err == nil {
		where = h.Name
	}
	f.event(ctx, vm.ID, "created", fmt.Sprintf("created on host %s (%d vCPU, %d MiB, %d GiB)", where, vm.VCPUs, vm.MemMB, vm.DiskGB))
	f.vmWritten(vm)
	return f.vmView(vm), nil
}

// place picks the host: the one named, or the connected host with the most
// free memory (then vCPUs) that fits.
func (f *Fleet) place(ctx context.Context, r *eitriv1.CreateVMRequest) (string, error) {
	fits := func(h store.Host) ([3]int64, string) {
		return f.room(ctx, f.st, h.ID, int64(r.GetVcpus()), r.GetMemMb(), r.GetDiskGb())
	}
	if id := r.GetHostId(); id != "" {
		h, err := f.st.HostByID(ctx, id)
		if errors.Is(err, store.ErrNotFound) {
			return "", invalid("host_id", "no host %q", id)
		} else if err != nil {
			return "", err
		}
		if _, why := fits(h); why != "" {
			return "", errorf(Precondition, "host %s %s", h.Name, why)
		}
		return h.ID, nil
	}
	hosts, err := f.st.ListHosts(ctx)
	if err != nil {
		return "", err
	}
	best, bestFree := "", [3]int64{-1, -1, -1}
	for _, h := range hosts {
		free, why := fits(h)
		if why != "" {
			continue
		}
		if free[1] > bestFree[1] || (free[1] == bestFree[1] && free[0] > bestFree[0]) {
			best, bestFree = h.ID, free
		}
	}
	if best == "" {
		return "", f.noRoom(ctx, hosts, r)
	}
	return best, nil
}

// room says whether a connected host has vcpus, memMB and diskGB free
// beyond what is allocated there, and what it has free; why is "" when it
// fits, else what a person reads after the host's name.
func (f *Fleet) room(ctx context.Context, rd reader, hostID string, vcpus, memMB, diskGB int64) (free [3]int64, why string) {
	live, ok := f.reg.Host(hostID)
	if !ok {
		return free, "is not connected"
	}
	c := live.Report.GetCapacity()
	if c == nil {
		return free, "has not reported its capacity yet"
	}
	a, err := f.allocated(ctx, rd, hostID)
	if err != nil {
		return free, err.Error()
	}
	free = [3]int64{int64(c.GetVcpus() - a.GetVcpus()), c.GetMemMb() - a.GetMemMb(), c.GetDiskGb() - a.GetDiskGb()}
	switch {
	case vcpus > free[0]:
		return free, fmt.Sprintf("has %d of %d vCPUs free", max(free[0], 0), c.GetVcpus())
	case memMB > free[1]:
		return free, fmt.Sprintf("has %d of %d MiB memory free", max(free[1], 0), c.GetMemMb())
	case diskGB > free[2]:
		return free, fmt.Sprintf("has %d of %d GiB disk free", max(free[2], 0), c.GetDiskGb())
	}
	return free, ""
}

// allocated sums what the host's VMs hold (see vmHolds): a failed create
// and a deleted VM's stopped guest give their share back.
func (f *Fleet) allocated(ctx context.Context, rd reader, hostID string) (*eitriv1.Allocated, error) {
	vms, err := rd.ListVMsByHost(ctx, hostID)
	if err != nil {
		return nil, err
	}
	a := &eitriv1.Allocated{}
	for _, v := range vms {
		c, m, d := vmHolds(v)
		a.Vcpus += int32(c)
		a.MemMb += m
		a.DiskGb += d
	}
	return a, nil
}

// visible loads a VM the caller may see; another user's VM is NotFound, so
// ids reveal nothing.
func (f *Fleet) visible(ctx context.Context, id string) (store.VM, auth.Principal, error) {
	p, err := principal(ctx)
	if err != nil {
		return store.VM{}, p, err
	}
	if id == "" {
		return store.VM{}, p, invalid("id", "required")
	}
	if err := checkLen("id", id, bounds.MaxIDLen); err != nil {
		return store.VM{}, p, err
	}
	vm, err := f.st.GetVM(ctx, id)
	if err != nil {
		return store.VM{}, p, storeErr(err, "vm "+id)
	}
	if !p.Admin && vm.OwnerID != p.UserID {
		return store.VM{}, p, errorf(NotFound, "vm %s not found", id)
	}
	return vm, p, nil
}

// GetVM returns one VM.
func (f *Fleet) GetVM(ctx context.Context, id string) (*eitriv1.VM, error) {
	vm, _, err := f.visible(ctx, id)
	if err != nil {
		return nil, err
	}
	return f.vmView(vm), nil
}

// ListVMs returns the caller's VMs (all, for an admin).
func (f *Fleet) ListVMs(ctx context.Context) ([]*eitriv1.VM, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	owner := ownerScope(p)
	vms, err := f.st.ListVMs(ctx, owner)
	if err != nil {
		return nil, err
	}
	out := make([]*eitriv1.VM, len(vms))
	for i, v := range vms {
		out[i] = f.vmView(v)
	}
	return out, nil
}

// SetPower records the desired power.
func (f *Fleet) SetPower(ctx context.Context, id, power string) (*eitriv1.VM, error) {
	if _, _, err := f.visible(ctx, id); err != nil {
		return nil, err
	}
	vm, changed, err := f.st.UpdateVM(ctx, id, func(v *store.VM) error {
		if v.DeletedAt != nil {
			return errorf(Precondition, "vm %s is deleted; restore it first", id)
		}
		if v.Status == vmstate.LifecycleLost {
			return errorf(Precondition, "vm %s is lost: %s", id, v.LastError)
		}
		v.PowerState = power
		return nil
	})
	if err != nil {
		return nil, storeErr(err, "vm "+id)
	}
	if changed {
		f.event(ctx, id, "power", "desired power set to "+power)
		f.vmWritten(vm)
	}
	return f.vmView(vm), nil
}

// DeleteVM soft-deletes: the host stops the guest and destroys it at
// destroy_at unless it is restored first.
func (f *Fleet) DeleteVM(ctx context.Context, id string) (*eitriv1.VM, error) {
	cur, _, err := f.visible(ctx, id)
	if err != nil {
		return nil, err
	}
	if cur.Status == vmstate.LifecycleLost {
		return f.deleteLost(ctx, cur)
	}
	now := f.now()
	vm, changed, err := f.st.UpdateVM(ctx, id, func(v *store.VM) error {
		if v.DeletedAt != nil {
			return nil // deleting twice is the same request
		}
		at := now.Add(f.cfg.DeleteGrace)
		v.DeletedAt, v.DestroyAt = &now, &at
		return nil
	})
	if err != nil {
		return nil, storeErr(err, "vm "+id)
	}
	if changed {
		f.event(ctx, id, "deleted", "deleted; restorable until "+f.restorableUntil(vm).Format("2006-01-02 15:04:05 MST"))
		f.vmWritten(vm)
		f.exposuresOfVMChanged(ctx, id)
	}
	return f.vmView(vm), nil
}

// RestoreVM undoes a delete that has not been carried out yet. The guest
// comes back, so its vCPUs and memory must fit its owner's quota and its
// host again (its disk never left either).
func (f *Fleet) RestoreVM(ctx context.Context, id string) (*eitriv1.VM, error) {
	cur, _, err := f.visible(ctx, id)
	if err != nil {
		return nil, err
	}
	now := f.now()
	if err := f.tooLateToRestore(cur, now); err != nil {
		return nil, err
	}
	f.quota.admit.Lock()
	defer f.quota.admit.Unlock()
	if cur.DeletedAt != nil {
		owner, err := f.st.UserByID(ctx, cur.OwnerID)
		if err != nil {
			return nil, err
		}
		restored := cur
		restored.DeletedAt = nil
		c, m, _ := vmHolds(restored)
		// The owner's quota, not the caller's: an admin restoring a user's
		// VM gives it back to that user.
		if err := f.admitQuota(ctx, f.st, auth.Principal{UserID: owner.ID, Name: owner.Name}, Usage{VMs: 1, VCPUs: c, MemMB: m}); err != nil {
			return nil, err
		}
		if c > 0 || m > 0 {
			if _, why := f.room(ctx, f.st, cur.HostID, c, m, 0); why != "" {
				where := cur.HostID
				if h, err := f.st.HostByID(ctx, cur.HostID); err == nil {
					where = h.Name
				}
				return nil, errorf(Precondition, "cannot restore vm %s: its host %s %s", id, where, why)
			}
		}
	}
	vm, changed, err := f.st.UpdateVM(ctx, id, func(v *store.VM) error {
		if v.DeletedAt == nil {
			return errorf(Precondition, "vm %s is not deleted", id)
		}
		if err := f.tooLateToRestore(*v, now); err != nil {
			return err
		}
		v.DeletedAt, v.DestroyAt = nil, nil
		return nil
	})
	if err != nil {
		return nil, storeErr(err, "vm "+id)
	}
	if changed {
		f.event(ctx, id, "restored", "restored")
		f.vmWritten(vm)
		f.exposuresOfVMChanged(ctx, id)
	}
	return f.vmView(vm), nil
}

// tooLateToRestore refuses a restore from RestoreMargin before destroy_at
// on: from destroy_at the host is told to destroy the disk, and a restore
// that raced it would bring back nothing.
func (f *Fleet) tooLateToRestore(v store.VM, now time.Time) error {
	until := f.restorableUntil(v)
	if until == nil || now.Before(*until) {
		return nil
	}
	return errorf(Precondition, "vm %s is destroyed at %s (restores close %s before); it cannot be restored",
		v.ID, v.DestroyAt.Format("2006-01-02 15:04:05 MST"), f.cfg.RestoreMargin)
}

func (f *Fleet) event(ctx context.Context, vmID, kind, msg string) {
	if err := f.st.AddVMEvent(ctx, store.VMEvent{VMID: vmID, At: f.now(), Kind: kind, Message: msg}); err != nil {
		f.log.Warn("record vm event", "vm", vmID, "err", err)
	}
}

// vmView merges the durable row with its host's live report.
func (f *Fleet) vmView(v store.VM) *eitriv1.VM {
	row, reporting := f.reg.VM(v.HostID, v.ID)
	lifecycle := Lifecycle(v, row, reporting)
	if row != nil {
		// The report reached the registry before its durable fields reach
		// the store: show them as the store will hold them, or a VM read in
		// between is "ready" without its address or host key.
		absorb(&v, row)
	}
	out := &eitriv1.VM{
		Id: v.ID, Name: v.Name, HostId: v.HostID, OwnerId: v.OwnerID,
		ImageUrl: v.ImageURL, ImageSha256: v.ImageSHA256,
		Vcpus: v.VCPUs, MemMb: v.MemMB, DiskGb: v.DiskGB,
		PowerState: v.PowerState, Status: v.Status, LastError: v.LastError,
		AssignedIp: v.AssignedIP, CreatedAt: timestamppb.New(v.CreatedAt),
		Deleted: v.DeletedAt != nil, SshAuthorizedKey: v.SSHAuthorizedKey,
		SshHostPubkey: v.SSHHostPubkey, Lifecycle: lifecycle,
		ImageName: v.ImageName, ImageVersion: v.ImageVersion,
	}
	if v.DestroyAt != nil {
		out.DestroyAt = timestamppb.New(*v.DestroyAt)
	}
	if t := f.restorableUntil(v); t != nil {
		out.RestorableUntil = timestamppb.New(*t)
	}
	if row != nil {
		out.ActualPower = row.GetPower()
		out.Phase = row.GetPhase()
		out.StatusDetail = row.GetStatusDetail()
		if p := row.GetProgress(); p != nil { // nil stays nil: nothing to measure
			out.Progress = proto.CloneOf(p) // the view is the caller's; the report row is the registry's
		}
		out.LoginUser = row.GetLoginUser()
		out.ReadySignal = row.GetReadySignal()
		if row.GetLastError() != "" {
			out.LastError = row.GetLastError()
		}
	}
	out.TrustedCas, out.TrustStale, out.TrustFix = f.userCATrust(v.UserCAKeys)
	return out
}

// Lifecycle derives the one word a person reads from the durable row (what
// was asked — deleted, desired power, retry — and the last status its host
// reported) and the live report row (nil when the host is not reporting on
// the VM). A request shows from the moment it is made: until the host's
// report catches up, the word says where the VM is going ("starting",
// "stopping", "restoring", "retrying"), and the next report confirms it.
func Lifecycle(v store.VM, row *eitriv1.ActualVM, reporting bool) string {
	if v.Status == vmstate.LifecycleLost {
		return vmstate.LifecycleLost // no host is left to say anything else
	}
	if v.DeletedAt != nil {
		return vmstate.LifecycleDeleting
	}
	if row == nil {
		// A connected host that has not picked the VM up yet, or a VM never
		// reported on: pending. A VM its host has reported before but is not
		// reporting now: nobody can say.
		if reporting || v.Status == "" || v.Status == vmstate.LifecyclePending {
			return vmstate.LifecyclePending
		}
		return vmstate.LifecycleUnknown
	}
	switch row.GetPhase() {
	case vmstate.PhaseFailed:
		if row.GetRetry() < v.Retry {
			return vmstate.LifecycleRetrying // the host has not seen the retry yet
		}
		return vmstate.LifecycleFailed
	case vmstate.PhaseCreating:
		return vmstate.LifecycleCreating
	case vmstate.PhaseDeleting:
		return vmstate.LifecycleRestoring // not deleted here: the host has not seen the restore yet
	case vmstate.PhaseStarting, vmstate.PhaseStopping, vmstate.PhaseRestarting:
		return row.GetPhase()
	case vmstate.PhaseReady, vmstate.PhaseStopped:
		running := row.GetPower() == vmstate.PowerRunning
		switch {
		case v.PowerState == vmstate.PowerRunning && !running:
			return vmstate.LifecycleStarting
		case v.PowerState == vmstate.PowerStopped && running:
			return vmstate.LifecycleStopping
		case running:
			return vmstate.LifecycleReady
		}
		return vmstate.LifecycleStopped
	}
	return vmstate.LifecyclePending
}

// vmWritten hands a VM as it was just written to every watcher, and tells
// its host (which reads its desired state anew). A change carries the row
// it wrote, so nothing reads it back by id.
func (f *Fleet) vmWritten(vm store.VM) {
	f.publishVMRow(vm)
	f.kick(vm.HostID)
}

// publishVM reads a VM by id and publishes it, or its removal when it is
// gone. Only for a change whose row this replica does not hold: one learned
// from another replica's change feed (the feed carries ids, not rows), or a
// host's report that moved durable facts this replica did not write.
// Whoever writes a row publishes it as written (vmWritten, publishVMRow).
func (f *Fleet) publishVM(ctx context.Context, id string) {
	vm, err := f.st.GetVM(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		// Its owner is unknown now, so only admins hear of it; whoever
		// removed it told its owner's watchers.
		f.vmRemoved(id, "")
		return
	}
	if err != nil {
		f.log.Warn("publish vm", "vm", id, "err", err)
		return
	}
	f.publishVMRow(vm)
}

// WatchVMs subscribes the caller and returns the current list to start from.
func (f *Fleet) WatchVMs(ctx context.Context, vmID string) (*watch.Watcher[*eitriv1.VM], []*eitriv1.VM, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, nil, err
	}
	if vmID == "" {
		w := f.VMs.Subscribe(ownerFilter[*eitriv1.VM](p))
		list, err := f.ListVMs(ctx)
		if err != nil {
			w.Close()
			return nil, nil, err
		}
		return w, list, nil
	}
	// One VM (a console's VM page): subscribe first, then read it, so no
	// change made in between is missed; an id the caller cannot see is
	// NotFound, as for every other call naming it.
	owner := ownerFilter[*eitriv1.VM](p)
	w := f.VMs.Subscribe(func(ev watch.Event[*eitriv1.VM]) bool {
		return ev.ID == vmID && (owner == nil || owner(ev))
	})
	vm, _, err := f.visible(ctx, vmID)
	if err != nil {
		w.Close()
		return nil, nil, err
	}
	return w, []*eitriv1.VM{f.vmView(vm)}, nil
}

func ownerFilter[T any](p auth.Principal) func(watch.Event[T]) bool {
	if p.Admin {
		return nil
	}
	// Removals carry their owner too: another user's ids are not yours to
	// hear about, not even as they go.
	return func(ev watch.Event[T]) bool { return ev.Owner == p.UserID }
}

// vmRemoved tells the owner's (and admins') watchers that a VM is gone.
func (f *Fleet) vmRemoved(id, owner string) {
	f.published.dropVM(id)
	f.VMs.Publish(watch.Event[*eitriv1.VM]{ID: id, Owner: owner, Removed: true})
}
