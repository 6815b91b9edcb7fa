package fleet

import (
	"context"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/callrelay"
)

// relayHosts is what the call relay learns of the hosts from the fleet.
type relayHosts struct{ f *Fleet }

func (h relayHosts) Instance(hostID string) (string, bool) {
	h.f.mu.Lock()
	defer h.f.mu.Unlock()
	s := h.f.sessions[hostID]
	if s == nil {
		return "", false
	}
	return s.instance, true
}

func (h relayHosts) HeldElsewhere(hostID string) bool { return h.f.heldElsewhere(hostID) }

// consoleTarget authorizes a console or tunnel request: the VM must be one
// the caller may see, and on a host.
func (f *Fleet) consoleTarget(ctx context.Context, id string) (callrelay.Target, error) {
	vm, p, err := f.visible(ctx, id)
	if err != nil {
		return callrelay.Target{}, err
	}
	if vm.HostID == "" {
		return callrelay.Target{}, errorf(Precondition, "vm %s is on no host (%s); it has no console", id, vm.Status)
	}
	return callrelay.Target{HostID: vm.HostID, Caller: p}, nil
}

// StreamConsole sends the VM's serial output through send; see
// callrelay.Relay.StreamConsole.
func (f *Fleet) StreamConsole(ctx context.Context, r *eitriv1.StreamConsoleRequest, send func(*eitriv1.StreamConsoleResponse) error) error {
	return f.Relay.StreamConsole(ctx, f.consoleTarget, r, send)
}

// SendConsoleInput types into the VM's serial console; see
// callrelay.Relay.SendConsoleInput.
func (f *Fleet) SendConsoleInput(ctx context.Context, r *eitriv1.SendConsoleInputRequest) error {
	return f.Relay.SendConsoleInput(ctx, f.consoleTarget, r)
}

// OpenTunnel relays one tunnel for the caller (see
// callrelay.Relay.OpenTunnel), and records it in the VM's events once it
// has reached its host.
func (f *Fleet) OpenTunnel(ctx context.Context, recv func() (*eitriv1.OpenTunnelRequest, error), send func(*eitriv1.OpenTunnelResponse) error) error {
	return f.Relay.OpenTunnel(ctx, f.consoleTarget, recv, send, func(e callrelay.TunnelEnd) {
		f.tunnelEnded(context.WithoutCancel(ctx), e)
	})
}
