package reconcile

import (
	"context"
	"fmt"

	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/wire/vmstate"
)

// Resources is an amount of what guests take from a host: a measured
// capacity, what VMs hold, or what one VM needs.
type Resources struct {
	VCPUs  int64
	MemMB  int64
	DiskGB int64
}

// vcpuOvercommit is how many guest vCPUs one host CPU may carry. vCPUs are
// time-shared, so more of them than CPUs only makes guests slower, never
// breaks them; memory and disk are not shared, so they are never
// overcommitted: a guest whose memory is not there is OOM-killed, and a
// full filesystem corrupts every overlay on it.
const vcpuOvercommit = 4

// admissionError is a create this host refuses for want of capacity. It is
// permanent: nothing the create does again makes room (a retry asked for
// after room was made checks again).
type admissionError struct{ msg string }

func (e admissionError) Error() string   { return e.msg + " (admission check)" }
func (e admissionError) Permanent() bool { return true }

// admit is the admission rule: the VM must fit what is left of the host's
// capacity after what the host's VMs hold (see holding).
func admit(capacity, held, need Resources) error {
	if free := max(capacity.MemMB-held.MemMB, 0); need.MemMB > free {
		return admissionError{fmt.Sprintf("host has %d MiB free for guests; vm needs %d MiB", free, need.MemMB)}
	}
	if free := max(capacity.DiskGB-held.DiskGB, 0); need.DiskGB > free {
		return admissionError{fmt.Sprintf("host has %d GiB of disk free for guests; vm needs %d GiB", free, need.DiskGB)}
	}
	if free := max(capacity.VCPUs*vcpuOvercommit-held.VCPUs, 0); need.VCPUs > free {
		return admissionError{fmt.Sprintf("host has %d vCPUs free for guests (%d CPUs, %dx overcommit, %d vCPUs in use); vm needs %d",
			free, capacity.VCPUs, vcpuOvercommit, held.VCPUs, need.VCPUs)}
	}
	return nil
}

func needs(spec state.VMSpec) Resources {
	return Resources{VCPUs: int64(spec.VCPUs), MemMB: spec.MemMB, DiskGB: spec.DiskGB}
}

// admitCreate checks that a create fits this host before it does any work,
// and from then on counts it as creating, so concurrent creates are judged
// one after another against each other. Without a Capacity every create is
// admitted; an unmeasurable host admits too, with a warning, as the control
// plane already placed the VM against what this host reported.
func (e *Engine) admitCreate(ctx context.Context, spec state.VMSpec) error {
	if e.cfg.Capacity == nil {
		return nil
	}
	e.admitMu.Lock()
	defer e.admitMu.Unlock()
	capacity, err := e.cfg.Capacity()
	if err != nil {
		e.log.Warn("cannot measure this host; admitting the create unchecked", "vm", spec.ID, "err", err)
		e.admitted[spec.ID] = true
		return nil
	}
	held, err := e.holding(ctx, spec.ID)
	if err != nil {
		return err
	}
	if err := admit(capacity, held, needs(spec)); err != nil {
		return err
	}
	e.admitted[spec.ID] = true
	return nil
}

// holding sums what this host's VMs other than except hold. A built VM holds
// its disk while it exists, and its vCPUs and memory while it runs or is
// wanted running (a crashed guest is booted again). An unbuilt VM holds all
// of it once admitted, until its create fails or it is deleted. Records are
// the source, not report rows: after a restart they know every VM before
// any pass has run. admitMu held.
func (e *Engine) holding(ctx context.Context, except string) (Resources, error) {
	ids, err := e.cfg.St.ListVMs()
	if err != nil {
		return Resources{}, fmt.Errorf("checking this host's capacity: %w", err)
	}
	var sum Resources
	for _, id := range ids {
		if id == except || e.isDestroyed(id) {
			continue
		}
		rec, ok, err := e.cfg.St.LoadVM(id)
		if err != nil {
			// It may be a running guest: not knowing is no room.
			return Resources{}, fmt.Errorf("checking this host's capacity: %w", err)
		}
		if !ok {
			continue
		}
		n := needs(rec.Spec)
		switch {
		case rec.BootID == "":
			if rec.Failed || rec.Deleted || !e.admitted[id] {
				continue
			}
		case !rec.Failed && !rec.Deleted && rec.Power == vmstate.PowerRunning:
		default:
			// Built and not wanted running: its disk, and its guest only
			// while it still runs (or its power cannot be read).
			if running, err := e.cfg.Hyper.Power(ctx, id); err == nil && !running {
				n.VCPUs, n.MemMB = 0, 0
			}
		}
		sum.VCPUs += n.VCPUs
		sum.MemMB += n.MemMB
		sum.DiskGB += n.DiskGB
	}
	return sum, nil
}

// forgetAdmitted stops counting a create that failed for good: a retry
// must pass the check again.
func (e *Engine) forgetAdmitted(id string) {
	e.admitMu.Lock()
	defer e.admitMu.Unlock()
	delete(e.admitted, id)
}
