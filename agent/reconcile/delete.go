package reconcile

import (
	"context"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// deleting handles a soft-deleted VM: stopped at once, disk kept until its
// destroy time, then destroyed for good.
func (e *Engine) deleting(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, ok bool) outcome {
	id := d.GetVmId()
	if !ok {
		// Nothing recorded: clear any leftovers and say it is gone.
		if err := e.destroy(ctx, id); err != nil {
			return outcome{row: newRow(id, rec, "", vmstate.PhaseDeleting, err.Error(), "")}
		}
		return outcome{gone: true, destroyed: true}
	}
	running, lastErr := e.stop(ctx, id)
	// Only the control plane's word destroys, said once its own clock has
	// passed destroy_at: this host's clock may run ahead of the one the
	// console's "restorable until" was read from.
	if d.GetDestroy() {
		err := e.destroy(ctx, id)
		if err == nil {
			return outcome{gone: true, destroyed: true}
		}
		lastErr = err.Error()
	}
	return outcome{row: newRow(id, rec, powerWord(running), vmstate.PhaseDeleting, lastErr, "")}
}

// destroy removes the VM and its record; on error something is left behind
// and the next pass tries again. The id is marked destroyed first, so from
// that moment on nothing builds it again, whatever a crash leaves.
func (e *Engine) destroy(ctx context.Context, id string) error {
	if err := e.cfg.St.MarkDestroyed(id, e.cfg.Now()); err != nil {
		e.log.Error("marking the VM destroyed", "vm", id, "err", err)
		return err
	}
	e.markDestroyed(id)
	if err := e.cfg.Hyper.Destroy(ctx, id); err != nil {
		e.log.Error("destroy failed", "vm", id, "err", err)
		return err
	}
	if err := e.cfg.St.DeleteVM(id); err != nil {
		e.log.Error("deleting VM record", "vm", id, "err", err)
		return err
	}
	e.log.Info("VM destroyed", "vm", id)
	return nil
}

// isDestroyed says whether this host has destroyed the VM.
func (e *Engine) isDestroyed(id string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	_, ok := e.destroyed[id]
	return ok
}

func (e *Engine) markDestroyed(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.destroyed[id]; !ok {
		e.destroyed[id] = e.cfg.Now().UTC()
	}
}
