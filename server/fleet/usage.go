package fleet

import (
	"context"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/usage"
	"github.com/a73x/eitri/server/watch"
)

// Usage takes one round of measurements from the host. A host speaks only
// for itself and for the VMs it reports holding, each placed on it; a
// sample of any other VM is dropped.
func (s *Session) Usage(ctx context.Context, u *eitriv1.UsageSample) {
	cleanFromHost(u)
	kept := s.f.addUsage(ctx, s.hostID, u)
	s.f.shareUsage(s, kept)
}

// addUsage records a round of hostID's measurements, from its own stream
// or another replica's, and returns what of it was kept.
func (f *Fleet) addUsage(ctx context.Context, hostID string, u *eitriv1.UsageSample) *eitriv1.UsageSample {
	kept := &eitriv1.UsageSample{}
	if h := u.GetHost(); h != nil {
		h.HostId = hostID // the credential, not the message, says who this is
		f.Usage.AddHost(h)
		kept.Host = h
	}
	for _, v := range u.GetVms() {
		if row, _ := f.reg.VM(hostID, v.GetVmId()); row == nil {
			continue
		}
		owner, ok := f.usageOwner(ctx, hostID, v.GetVmId())
		if !ok {
			continue
		}
		v.HostId = hostID
		f.Usage.AddVM(owner, v)
		kept.Vms = append(kept.Vms, v)
	}
	return kept
}

// usageOwner is the owner of a VM placed on hostID: from the usage series
// when it has one, else from the store (once per series, not per sample).
func (f *Fleet) usageOwner(ctx context.Context, hostID, vmID string) (string, bool) {
	if owner, host, ok := f.Usage.Owner(vmID); ok && host == hostID {
		return owner, true
	}
	vm, err := f.st.GetVM(ctx, vmID)
	if err != nil || vm.HostID != hostID {
		return "", false
	}
	return vm.OwnerID, true
}

// WatchUsage returns a watcher of the usage the caller may see, and the
// window held for it: one VM (vmID), one host (hostID), or, with neither,
// the caller's VMs (every VM for an admin) and every host — as ListVMs and
// ListHosts show them.
func (f *Fleet) WatchUsage(ctx context.Context, vmID, hostID string) (*watch.Watcher[*eitriv1.WatchUsageResponse], *eitriv1.UsageWindow, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, nil, err
	}
	sc := usage.Scope{Owner: ownerScope(p)}
	switch {
	case vmID != "" && hostID != "":
		return nil, nil, invalid("host_id", "name a VM or a host, not both")
	case vmID != "":
		if _, _, err := f.visible(ctx, vmID); err != nil {
			return nil, nil, err
		}
		sc.VMID = vmID
	case hostID != "":
		if _, err := f.hostByID(ctx, hostID); err != nil {
			return nil, nil, err
		}
		sc.HostID = hostID
	}
	w, win := f.Usage.Watch(sc)
	return w, win, nil
}
