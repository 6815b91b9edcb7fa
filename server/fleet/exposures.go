package fleet

import (
	"context"
	"errors"
	"strconv"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
)

// CreateExposure publishes a guest port on the VM's host.
func (f *Fleet) CreateExposure(ctx context.Context, r *eitriv1.CreateExposureRequest) (*eitriv1.Exposure, error) {
	if r.GetVmId() == "" {
		return nil, invalid("vm_id", "required")
	}
	proto, scope := r.GetProtocol(), r.GetScope()
	if proto == "" {
		proto = "tcp"
	}
	if scope == "" {
		scope = "lan"
	}
	switch {
	case r.GetGuestPort() < 1 || r.GetGuestPort() > 65535:
		return nil, invalid("guest_port", "must be between 1 and 65535, got %d", r.GetGuestPort())
	case r.GetHostPort() > 65535:
		return nil, invalid("host_port", "must be between 1 and 65535 (or 0 to allocate), got %d", r.GetHostPort())
	case proto != "tcp" && proto != "udp":
		return nil, invalid("protocol", `must be "tcp" or "udp", got %q`, r.GetProtocol())
	case scope != "lan" && scope != "local":
		return nil, invalid("scope", `must be "lan" or "local", got %q`, r.GetScope())
	}
	vm, _, err := f.visible(ctx, r.GetVmId())
	if err != nil {
		return nil, err
	}
	if vm.DeletedAt != nil {
		return nil, errorf(Precondition, "vm %s is deleted", vm.ID)
	}
	port := uint16(r.GetHostPort())
	if port == 0 {
		if port, err = f.freePort(ctx, vm.HostID, proto); err != nil {
			return nil, err
		}
	}
	e := store.Exposure{
		ID: newID("x"), VMID: vm.ID, HostID: vm.HostID,
		GuestPort: uint16(r.GetGuestPort()), HostPort: port,
		Protocol: proto, Scope: scope, MaxSessions: r.GetMaxSessions(), CreatedAt: f.now(),
	}
	if err := f.st.CreateExposure(ctx, e); err != nil {
		return nil, storeErr(err, "exposure")
	}
	f.event(ctx, vm.ID, "exposure", "published "+proto+" guest port "+strconv.Itoa(int(e.GuestPort))+" on host port "+strconv.Itoa(int(e.HostPort)))
	f.publishExposure(ctx, e.ID)
	f.kick(vm.HostID)
	return f.exposureView(ctx, e), nil
}

func (f *Fleet) freePort(ctx context.Context, hostID, proto string) (uint16, error) {
	used, err := f.st.UsedHostPorts(ctx, hostID, proto)
	if err != nil {
		return 0, err
	}
	for p := int(f.cfg.PortMin); p <= int(f.cfg.PortMax); p++ {
		if !used[uint16(p)] {
			return uint16(p), nil
		}
	}
	return 0, errorf(Precondition, "host %s has no free %s port in %d-%d", hostID, proto, f.cfg.PortMin, f.cfg.PortMax)
}

// ListExposures lists one VM's exposures, or every exposure the caller can
// see when vmID is empty.
func (f *Fleet) ListExposures(ctx context.Context, vmID string) ([]*eitriv1.Exposure, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	owners := map[string]string{} // vm id → owner
	if vmID != "" {
		vm, _, err := f.visible(ctx, vmID)
		if err != nil {
			return nil, err
		}
		owners[vm.ID] = vm.OwnerID
	} else {
		owner := ownerScope(p)
		vms, err := f.st.ListVMs(ctx, owner)
		if err != nil {
			return nil, err
		}
		for _, v := range vms {
			owners[v.ID] = v.OwnerID
		}
	}
	exps, err := f.st.ListExposures(ctx, vmID)
	if err != nil {
		return nil, err
	}
	out := []*eitriv1.Exposure{}
	for _, e := range exps {
		if _, ok := owners[e.VMID]; ok {
			out = append(out, f.exposureView(ctx, e))
		}
	}
	return out, nil
}

// DeleteExposure unpublishes a port.
func (f *Fleet) DeleteExposure(ctx context.Context, id string) error {
	if id == "" {
		return invalid("id", "required")
	}
	e, err := f.st.GetExposure(ctx, id)
	if err != nil {
		return storeErr(err, "exposure "+id)
	}
	if _, _, err := f.visible(ctx, e.VMID); err != nil {
		if KindOf(err) == NotFound {
			return errorf(NotFound, "exposure %s not found", id)
		}
		return err
	}
	if err := f.st.DeleteExposure(ctx, id); err != nil {
		return storeErr(err, "exposure "+id)
	}
	f.event(ctx, e.VMID, "exposure", "unpublished host port "+strconv.Itoa(int(e.HostPort))+"/"+e.Protocol)
	f.Exposures.Publish(watch.Event[*eitriv1.Exposure]{ID: id, Removed: true})
	f.kick(e.HostID)
	return nil
}

// exposureView merges the durable row with its host's live report. Sessions
// stay nil unless the host counted: null is never turned into zeros.
func (f *Fleet) exposureView(ctx context.Context, e store.Exposure) *eitriv1.Exposure {
	out := &eitriv1.Exposure{
		Id: e.ID, VmId: e.VMID, HostId: e.HostID,
		GuestPort: uint32(e.GuestPort), HostPort: uint32(e.HostPort),
		Protocol: e.Protocol, Scope: e.Scope, State: "pending",
		MaxSessions: e.MaxSessions, CreatedAt: timestamppb.New(e.CreatedAt),
	}
	if e.Scope == "local" {
		out.HostAddr = "127.0.0.1"
	} else if live, ok := f.reg.Host(e.HostID); ok {
		out.HostAddr = live.Hello.GetAddress()
	} else if h, err := f.st.HostByID(ctx, e.HostID); err == nil {
		out.HostAddr = h.Address
	}
	if row := f.reg.Exposure(e.HostID, e.ID); row != nil {
		out.State, out.Reason = row.GetState(), row.GetReason()
		if s := row.GetSessions(); s != nil {
			out.Sessions = &eitriv1.ExposureSessions{Active: s.GetActive(), Refused: s.GetRefused(), Dropped: s.GetDropped()}
		}
	}
	return out
}

func (f *Fleet) publishExposure(ctx context.Context, id string) {
	e, err := f.st.GetExposure(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		f.Exposures.Publish(watch.Event[*eitriv1.Exposure]{ID: id, Removed: true})
		return
	}
	if err != nil {
		f.log.Warn("publish exposure", "exposure", id, "err", err)
		return
	}
	vm, err := f.st.GetVM(ctx, e.VMID)
	if err != nil {
		return
	}
	f.Exposures.Publish(watch.Event[*eitriv1.Exposure]{ID: id, Owner: vm.OwnerID, Obj: f.exposureView(ctx, e)})
}

func (f *Fleet) exposuresOfVMChanged(ctx context.Context, vmID string) {
	exps, err := f.st.ListExposures(ctx, vmID)
	if err != nil {
		return
	}
	for _, e := range exps {
		f.publishExposure(ctx, e.ID)
	}
}

// WatchExposures subscribes the caller (optionally to one VM) and returns
// the current list to start from.
func (f *Fleet) WatchExposures(ctx context.Context, vmID string) (*watch.Watcher[*eitriv1.Exposure], []*eitriv1.Exposure, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, nil, err
	}
	owner := ownerFilter[*eitriv1.Exposure](p)
	filter := func(ev watch.Event[*eitriv1.Exposure]) bool {
		if owner != nil && !owner(ev) {
			return false
		}
		return vmID == "" || ev.Removed || ev.Obj.GetVmId() == vmID
	}
	w := f.Exposures.Subscribe(filter)
	list, err := f.ListExposures(ctx, vmID)
	if err != nil {
		w.Close()
		return nil, nil, err
	}
	return w, list, nil
}
