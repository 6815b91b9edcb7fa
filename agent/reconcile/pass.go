package reconcile

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// publisher lands a row mid-pass. Nil means nobody is collecting; narration
// is then skipped.
type publisher func(*eitriv1.ActualVM)

// outcome is what one pass leaves behind.
type outcome struct {
	row  *eitriv1.ActualVM
	quar *eitriv1.QuarantinedVM
	// skip: the pass could not run (unreadable record, engine closing); the
	// VM keeps its last row.
	skip bool
	// gone: nothing of the VM is left on this host; destroyed says it was
	// this engine that destroyed it (reported in Destroyed).
	gone, destroyed bool
	// holdCreate: a stop cancelled the create; keep the VM unbuilt until it
	// is wanted running (the worker remembers).
	holdCreate bool
	// wakeAt: the VM waits out a backoff until then; the worker runs a pass
	// at that time without being asked.
	wakeAt time.Time
}

// hostFault is how building blocks mark a failure that was the host's, not
// the VM's, and that the host has already dealt with (KVM broke and the
// host moved to another accelerator): retried without spending an attempt.
type hostFault interface{ HostFault() bool }

func isHostFault(err error) bool {
	var h hostFault
	return errors.As(err, &h) && h.HostFault()
}

// pass is one VM's complete unit of work: load its record and drive it toward
// d (nil: no snapshot names it). Bounded by VMTimeout; parent is cancelled,
// with a cause abandoned recognises, when newer desired state no longer wants
// what the pass is doing. holdCreate: a stop cancelled this VM's create.
func (e *Engine) pass(parent context.Context, id string, d *eitriv1.VMDesired, prev *eitriv1.ActualVM, holdCreate bool, pub publisher) outcome {
	ctx, cancel := e.passContext(parent)
	defer cancel()

	rec, ok, err := e.cfg.St.LoadVM(id)
	if err != nil {
		// Never "absent": acting on an unreadable record could create a VM on
		// top of a running one. Keep the last row until the store recovers.
		e.log.Error("cannot read VM record; skipping", "vm", id, "err", err)
		return outcome{skip: true}
	}
	if e.isDestroyed(id) {
		// Destroyed, but the record outlived it (a crash mid-destroy):
		// finish the job. Nothing is ever built again under this id.
		if err := e.destroy(ctx, id); err != nil {
			return outcome{skip: true}
		}
		return outcome{gone: true, destroyed: true}
	}
	if d == nil {
		return e.hold(ctx, id, rec, ok, false, "no snapshot names it, and no delete of it reached this host")
	}
	if ok && d.GetVersion() < rec.Version {
		return e.hold(ctx, id, rec, ok, true, fmt.Sprintf("the control plane's record of it (version %d) is older than what this host applied (version %d)",
			d.GetVersion(), rec.Version))
	}
	if ok && !rec.QuarantinedAt.IsZero() {
		// Named again, and as new as what it holds: adopt what is here
		// rather than recreate it.
		rec.QuarantinedAt = time.Time{}
		if err := e.cfg.St.SaveVM(id, rec); err != nil {
			e.log.Error("saving adopted VM record", "vm", id, "err", err)
		}
		e.log.Info("VM is wanted again; no longer held", "vm", id)
	}
	if rec.Version != d.GetVersion() || rec.Power != d.GetPowerState() || rec.Deleted != d.GetDeleted() {
		// Recorded before it is acted on: from here on, a record of this VM
		// older than this is not taken at its word.
		rec.Version, rec.Power, rec.Deleted = d.GetVersion(), d.GetPowerState(), d.GetDeleted()
		if ok {
			if err := e.cfg.St.SaveVM(id, rec); err != nil {
				e.log.Error("saving the applied desired state", "vm", id, "err", err)
			}
		}
	}
	if applyRetry(d, &rec) && ok {
		e.log.Info("retry asked for; the VM's budgets start over", "vm", id, "retry", rec.Retry)
		if err := e.cfg.St.SaveVM(id, rec); err != nil {
			e.log.Error("saving the retried VM record", "vm", id, "err", err)
		}
	}
	if d.GetDeleted() {
		return e.deleting(ctx, d, rec, ok)
	}
	if !ok || rec.BootID == "" {
		if ok && holdCreate && !wantRunning(d) {
			return e.keepUnbuilt(ctx, id, rec)
		}
		return e.create(ctx, d, rec, ok, pub)
	}
	out := e.converge(ctx, d, rec, prev, pub)
	if abandoned(ctx) != nil {
		// A boot cut short by a stop or a delete would report the
		// cancellation as an error; the pass that follows at once says
		// what is true.
		return outcome{skip: true}
	}
	return out
}

// converge drives an existing VM's power toward desired (see start and
// shutDown) and refreshes its address.
func (e *Engine) converge(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, prev *eitriv1.ActualVM, pub publisher) outcome {
	id := d.GetVmId()
	if rec.Spec.Owner != d.GetOwner() {
		rec = e.setOwner(ctx, id, rec, d.GetOwner())
	}
	if rec.Failed {
		// Its restarts ran out: stopped until someone retries it.
		running, lastErr := e.stop(ctx, id)
		return outcome{row: newRow(id, rec, powerWord(running), vmstate.PhaseFailed, cmp.Or(rec.LastError, lastErr), "")}
	}
	if wantRunning(d) {
		// Before a start too, so a guest that was stopped for weeks finds
		// a current certificate when it boots.
		rec = e.renewHostCert(ctx, id, rec)
	}
	running, err := e.cfg.Hyper.Power(ctx, id)
	if err != nil {
		return outcome{row: unknownPowerRow(id, rec, prev, err)}
	}
	switch {
	case wantRunning(d) && !running:
		return e.start(ctx, d, rec, pub)
	case !wantRunning(d) && running:
		return e.shutDown(ctx, d, rec, pub)
	case !running:
		// Stopped as wanted. A guest that ended unasked just before a stop
		// still ended unasked: counted, but not restarted.
		rec = e.noteExit(ctx, rec)
		return e.observeKnown(ctx, d, rec, false, "", vmstate.PhaseStopped)
	}
	rec = e.forgetStableFailures(rec)
	return e.observeKnown(ctx, d, rec, true, "", e.runningPhase(rec))
}

// setOwner moves a created VM to the owner the desired state names. The
// owner is the one part of a created VM's spec that follows the desired
// state: a control plane that starts sending owners must not leave its
// guests isolated until they reboot. The record changes only once the
// hypervisor has, so a failure is retried by the next pass.
func (e *Engine) setOwner(ctx context.Context, id string, rec state.Record, owner string) state.Record {
	if err := e.cfg.Hyper.SetOwner(ctx, id, owner); err != nil {
		e.log.Warn("changing the VM's owner failed; will retry", "vm", id, "err", err)
		return rec
	}
	e.log.Info("VM owner changed", "vm", id, "owner", owner, "was", rec.Spec.Owner)
	rec.Spec.Owner = owner
	if err := e.cfg.St.SaveVM(id, rec); err != nil {
		e.log.Error("saving VM owner", "vm", id, "err", err)
	}
	return rec
}

func wantRunning(d *eitriv1.VMDesired) bool { return d.GetPowerState() == vmstate.PowerRunning }
