package fleet

import (
	"context"
	"errors"
	"fmt"
	"time"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
)

// ForceDecommissionAfter is how long a host must have been gone before it
// may be decommissioned by force. Long enough that a reboot, an agent
// upgrade or a short link outage is never mistaken for a dead machine.
const ForceDecommissionAfter = 10 * time.Minute

// ForceDecommissionHost removes a host that is gone for good, VMs and all:
// its VMs are kept as rows marked lost, its deleted VMs (whose destroy can
// never be confirmed) and its exposures are removed. It is refused while
// the host is connected or was seen less than ForceDecommissionAfter ago.
func (f *Fleet) ForceDecommissionHost(ctx context.Context, id string) (*eitriv1.DecommissionHostResponse, error) {
	if _, err := requireAdmin(ctx); err != nil {
		return nil, err
	}
	h, err := f.hostByID(ctx, id)
	if err != nil {
		return nil, err
	}
	if _, connected := f.reg.Host(id); connected {
		return nil, errorf(Precondition, "host %s is connected; force is only for a host that is gone for good (delete its VMs, then decommission it without force)", h.Name)
	}
	now := f.now()
	seen, what := h.CreatedAt, "enrolled"
	if h.LastSeenAt != nil {
		seen, what = *h.LastSeenAt, "last seen"
	}
	if gone := now.Sub(seen); gone < ForceDecommissionAfter {
		return nil, errorf(Precondition, "host %s was %s %s ago; force needs it gone for %s (try again in %s)",
			h.Name, what, gone.Round(time.Second), ForceDecommissionAfter, (ForceDecommissionAfter - gone).Round(time.Second))
	}
	why := fmt.Sprintf("lost: its host %s (%s) was decommissioned by force at %s, unreachable since %s; nothing on that machine was recovered",
		h.Name, h.ID, now.Format(time.RFC3339), seen.Format(time.RFC3339))
	loss, err := f.st.ForgetUnreachableHost(ctx, id, now.Add(-ForceDecommissionAfter), now, func(store.VM) string { return why })
	if errors.Is(err, store.ErrConflict) {
		return nil, errorf(Precondition, "host %s was seen again; it is not gone", h.Name)
	}
	if err != nil {
		return nil, storeErr(err, "host "+id)
	}
	f.log.Warn("host decommissioned by force", "host", id, "name", h.Name, "unreachable_since", seen,
		"lost_vms", len(loss.Lost), "forgotten_vms", len(loss.Forgotten), "exposures", len(loss.Exposures))

	f.endHost(id)
	owners := map[string]string{} // vm id → owner, for the exposures' watchers
	resp := &eitriv1.DecommissionHostResponse{}
	for _, v := range loss.Lost {
		owners[v.ID] = v.OwnerID
		resp.LostVmIds = append(resp.LostVmIds, v.ID)
		f.event(ctx, v.ID, "lost", why)
		f.VMs.Publish(watch.Event[*eitriv1.VM]{ID: v.ID, Owner: v.OwnerID, Obj: f.vmView(v)})
	}
	for _, v := range loss.Forgotten {
		owners[v.ID] = v.OwnerID
		resp.ForgottenVmIds = append(resp.ForgottenVmIds, v.ID)
		f.vmRemoved(v.ID, v.OwnerID)
	}
	for _, e := range loss.Exposures {
		f.exposureRemoved(e, owners[e.VMID])
	}
	f.Hosts.Publish(watch.Event[*eitriv1.Host]{ID: id, Removed: true})
	// What it measured goes with it, not an hour later.
	f.Usage.DropHost(id)
	return resp, nil
}

// endHost closes a removed host's stream, if one is somehow open: its
// credential no longer works.
func (f *Fleet) endHost(id string) {
	f.mu.Lock()
	if s := f.sessions[id]; s != nil {
		s.cancel(errors.New("host decommissioned"))
	}
	f.mu.Unlock()
}

// deleteLost removes a lost VM's row at once: no host is left to destroy
// anything, so there is nothing to wait for and nothing to restore.
func (f *Fleet) deleteLost(ctx context.Context, vm store.VM) (*eitriv1.VM, error) {
	exps, _ := f.st.ListExposures(ctx, vm.ID)
	if err := f.st.DeleteVM(ctx, vm.ID); err != nil {
		return nil, storeErr(err, "vm "+vm.ID)
	}
	for _, e := range exps {
		f.exposureRemoved(e, vm.OwnerID)
	}
	f.vmRemoved(vm.ID, vm.OwnerID)
	out := f.vmView(vm)
	out.Deleted = true
	return out, nil
}
