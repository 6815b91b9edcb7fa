package reconcile

import (
	"context"
	"net/netip"

	"github.com/a73x/eitri/agent/state"
)

// The narration words: what a VM's row says it is doing (ActualVM
// status_detail) while it is between settled phases.

// Narration, in the order a create says it.
const (
	sayWaitingForSlot = "waiting for a create slot on this host"
	sayDownloading    = "downloading image"
	sayCachedImage    = "using the cached image"
	sayPreparingDisk  = "preparing root disk"
	sayCertifying     = "certifying the SSH host key"
	sayUncertified    = "SSH host key not certified, the guest boots without a host certificate: "
	sayBuildingSeed   = "building the cloud-init seed"
	sayBooting        = "booting"
	// SayWaitingForAddress: the guest runs and has not taken its address.
	// The hypervisor's Boot says it once QEMU is up, and a pass says it of
	// a running guest it finds without one; exported so both say one word.
	SayWaitingForAddress = "waiting for an address"
	// sayWaitingForReady: the guest has its address, not yet a sign that
	// it is usable (the hypervisor's Boot narrates what it waits for).
	sayWaitingForReady = "waiting for the guest to finish booting"
)

// Narration of a created VM's power, in the order a start or a stop says it.
const (
	sayStarting     = "starting"
	sayShuttingDown = "shutting down (ACPI)"
)

type narratorKey struct{}

// Narrate lets a building block say what it is doing in the middle of a
// call (SayWaitingForAddress, "forcing off after 30 s"): the engine
// hands Boot and Shutdown a context that carries its pass's publisher.
// Outside a pass, or once the pass's context is done, it says nothing, so a
// line can never outlive the pass that said it. Boot narrates only once the
// guest process runs.
func Narrate(ctx context.Context, detail string) {
	NarrateAddress(ctx, netip.Addr{}, detail)
}

// NarrateAddress is Narrate for a boot whose guest has taken its address
// but is not ready yet ("waiting for cloud-init"): the row carries the
// address from then on, so it is known while the guest finishes booting.
func NarrateAddress(ctx context.Context, addr netip.Addr, detail string) {
	if say, ok := ctx.Value(narratorKey{}).(func(string, netip.Addr)); ok && ctx.Err() == nil {
		say(detail, addr)
	}
}

func withNarrator(ctx context.Context, say func(string, netip.Addr)) context.Context {
	return context.WithValue(ctx, narratorKey{}, say)
}

// sayer publishes the VM's row with phase, power and a detail, while ctx is
// live and somebody collects. An address it is told goes into the record
// (the pass saves it with the rest).
func sayer(ctx context.Context, pub publisher, id string, rec *state.Record, power, phase string) func(string, netip.Addr) {
	return func(detail string, addr netip.Addr) {
		if pub == nil || ctx.Err() != nil {
			return
		}
		if addr.IsValid() {
			rec.IP = addr.String()
		}
		pub(newRow(id, *rec, power, phase, "", detail))
	}
}
