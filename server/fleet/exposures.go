package fleet

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"sync"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/bounds"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/vmstate"
)

// CreateExposure publishes a guest port on the VM's host.
func (f *Fleet) CreateExposure(ctx context.Context, r *eitriv1.CreateExposureRequest) (*eitriv1.Exposure, error) {
	if r.GetVmId() == "" {
		return nil, invalid("vm_id", "required")
	}
	if err := checkLen("protocol", r.GetProtocol(), 8); err != nil {
		return nil, err
	}
	if err := checkLen("scope", r.GetScope(), 8); err != nil {
		return nil, err
	}
	proto, scope := r.GetProtocol(), r.GetScope()
	if proto == "" {
		proto = "tcp"
	}
	if scope == "" {
		scope = "lan"
	}
	switch {
	case r.GetGuestPort() < 1 || r.GetGuestPort() > bounds.MaxPort:
		return nil, invalid("guest_port", "must be between 1 and %d, got %d", bounds.MaxPort, r.GetGuestPort())
	case r.GetHostPort() > bounds.MaxPort:
		return nil, invalid("host_port", "must be between 1 and %d (or 0 to allocate), got %d", bounds.MaxPort, r.GetHostPort())
	case proto != "tcp" && proto != "udp":
		return nil, invalid("protocol", `must be "tcp" or "udp", got %q`, r.GetProtocol())
	case scope != "lan" && scope != "local":
		return nil, invalid("scope", `must be "lan" or "local", got %q`, r.GetScope())
	}
	vm, p, err := f.visible(ctx, r.GetVmId())
	if err != nil {
		return nil, err
	}
	if vm.DeletedAt != nil {
		return nil, errorf(Precondition, "vm %s is deleted", vm.ID)
	}
	if vm.Status == vmstate.LifecycleLost {
		return nil, errorf(Precondition, "vm %s is lost: %s", vm.ID, vm.LastError)
	}
	port := uint16(r.GetHostPort())
	if port != 0 {
		if err := f.hostPortAllowed(p, proto, port); err != nil {
			return nil, err
		}
	}
	f.quota.admit.Lock()
	defer f.quota.admit.Unlock()
	if err := f.admitQuota(ctx, f.st, p, Usage{Exposures: 1}); err != nil {
		return nil, err
	}
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
		var held *store.PortHeldError
		if errors.As(err, &held) {
			return nil, f.portTaken(ctx, p, held)
		}
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
		if !used[uint16(p)] && f.reserved.whose(proto, uint16(p)) == "" {
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
	if err := checkLen("id", id, bounds.MaxIDLen); err != nil {
		return err
	}
	e, err := f.st.GetExposure(ctx, id)
	if err != nil {
		return storeErr(err, "exposure "+id)
	}
	vm, _, err := f.visible(ctx, e.VMID)
	if err != nil {
		if KindOf(err) == NotFound {
			return errorf(NotFound, "exposure %s not found", id)
		}
		return err
	}
	if err := f.st.DeleteExposure(ctx, id); err != nil {
		return storeErr(err, "exposure "+id)
	}
	f.event(ctx, e.VMID, "exposure", "unpublished host port "+strconv.Itoa(int(e.HostPort))+"/"+e.Protocol)
	f.exposureRemoved(e, vm.OwnerID)
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
			// The bytes keep their own null: an agent that counts sessions
			// but not bytes leaves them unset.
			out.Sessions = &eitriv1.ExposureSessions{Active: s.GetActive(), Refused: s.GetRefused(), Dropped: s.GetDropped(),
				Carried: s.GetCarried()}
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
	f.published.putExposure(e, vm.OwnerID)
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
		// A removal carries a stub with its VM's id (see exposureRemoved).
		return vmID == "" || ev.Obj.GetVmId() == vmID
	}
	w := f.Exposures.Subscribe(filter)
	list, err := f.ListExposures(ctx, vmID)
	if err != nil {
		w.Close()
		return nil, nil, err
	}
	return w, list, nil
}

// exposureRemoved tells the owner's (and admins') watchers that an exposure
// is gone. The event carries its owner and a stub naming its VM, so other
// users' watchers never hear of it and a VM's watcher hears only of its own.
func (f *Fleet) exposureRemoved(e store.Exposure, owner string) {
	f.published.dropExposure(e.ID)
	f.Exposures.Publish(watch.Event[*eitriv1.Exposure]{ID: e.ID, Owner: owner, Removed: true,
		Obj: &eitriv1.Exposure{Id: e.ID, VmId: e.VMID}})
}

// reservedPorts are host ports no exposure may take, an admin's included:
// the agent's own listeners and the control plane's port. The control
// plane's is refused on every host, since it may share one with an agent
// (eitri dev always does) and the fleet cannot tell which.
type reservedPorts struct {
	mu sync.Mutex
	by map[string]string // "tcp/7443" → whose it is
}

func portKey(proto string, port uint16) string { return proto + "/" + strconv.Itoa(int(port)) }

func builtinReserved(publicURL string) *reservedPorts {
	r := &reservedPorts{by: map[string]string{
		portKey("udp", 67): "the port of the agent's DHCP server for its guests",
		// On the bridge address only, but a "lan" exposure listens on
		// every address and would collide.
		portKey("udp", 53):   "the port of the agent's DNS forwarder for its guests",
		portKey("tcp", 53):   "the port of the agent's DNS forwarder for its guests",
		portKey("tcp", 7480): "the port of the agent's phone-home endpoint for its guests",
	}}
	// Every URL the control plane answers at: a host may run a replica.
	for _, pub := range connclient.SplitURLs(publicURL) {
		u, err := url.Parse(pub)
		if err != nil || u.Host == "" {
			continue
		}
		port := u.Port()
		if port == "" && u.Scheme == "https" {
			port = "443"
		} else if port == "" {
			port = "80"
		}
		if n, err := strconv.ParseUint(port, 10, 16); err == nil {
			r.by[portKey("tcp", uint16(n))] = controlPlanePort
		}
	}
	return r
}

const controlPlanePort = "the control plane's own port"

// ReserveControlPort keeps exposures off the port the control plane
// listens on (which may differ from its public URL's, behind a proxy).
func (f *Fleet) ReserveControlPort(port uint16) {
	f.reserved.mu.Lock()
	defer f.reserved.mu.Unlock()
	f.reserved.by[portKey("tcp", port)] = controlPlanePort
}

func (r *reservedPorts) whose(proto string, port uint16) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.by[portKey(proto, port)]
}

// hostPortAllowed is the rule for a host port a caller names: never a
// reserved one; for anyone but an admin, only one of the allocation range,
// so a tenant cannot take 22, 25, 443 or 53 on a shared host.
func (f *Fleet) hostPortAllowed(p auth.Principal, proto string, port uint16) error {
	if whose := f.reserved.whose(proto, port); whose != "" {
		return invalid("host_port", "%d/%s is %s; no exposure may take it", port, proto, whose)
	}
	if !p.Admin && (port < f.cfg.PortMin || port > f.cfg.PortMax) {
		return errorf(Denied, "host_port: %d is outside the range %d-%d that exposures are given ports from; only an admin may choose another (or leave host_port unset to get a free one)",
			port, f.cfg.PortMin, f.cfg.PortMax)
	}
	return nil
}

// portTaken words a port conflict. The holder is named only to someone who
// may see it: another user's exposure id is none of the caller's business.
func (f *Fleet) portTaken(ctx context.Context, p auth.Principal, held *store.PortHeldError) error {
	msg := fmt.Sprintf("host_port: %d/%s on host %s is taken", held.HostPort, held.Protocol, held.HostID)
	if x, err := f.st.GetExposure(ctx, held.ExposureID); err == nil {
		if vm, err := f.st.GetVM(ctx, x.VMID); err == nil && (p.Admin || vm.OwnerID == p.UserID) {
			msg += " by exposure " + held.ExposureID
		}
	}
	return &Error{Kind: Conflict, Msg: msg}
}
