package reconcile

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// bootPhase is the phase of a created VM being booted: restarting while its
// last runs failed, starting otherwise.
func (e *Engine) bootPhase(rec state.Record) string {
	if rec.Restarts > 0 {
		return vmstate.PhaseRestarting
	}
	return vmstate.PhaseStarting
}

// runningPhase is the phase of a guest running as wanted but not ready yet:
// still creating while the create's own boot comes up (a later pass must not
// call it starting), else as bootPhase.
func (e *Engine) runningPhase(rec state.Record) string {
	if rec.FirstBoot && rec.Restarts == 0 {
		return vmstate.PhaseCreating
	}
	return e.bootPhase(rec)
}

// start boots a created VM that is wanted running and is not, and says so.
// A guest that ended unasked is restarted, and the exit is counted and
// described in every row from then on; failed runs in a row back off, and
// past MaxRestarts the VM fails with the reason, stopped until a retry.
func (e *Engine) start(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, pub publisher) outcome {
	id := d.GetVmId()
	if x, ok := e.cfg.Hyper.Exited(ctx, id); ok {
		rec = e.recordExit(rec, x)
		rec = e.failedRun(rec, x.Reason)
		if rec.Failed {
			return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseFailed, rec.LastError, "")}
		}
	}
	if wait := rec.RestartAt.Sub(e.cfg.Now()); wait > 0 {
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseRestarting, "", restartWords(rec, wait)), wakeAt: rec.RestartAt}
	}

	phase, detail := e.bootPhase(rec), sayStarting
	if rec.Restarts > 0 {
		detail = restartWords(rec, 0)
	}
	sayer(ctx, pub, id, &rec, vmstate.PowerStopped, phase)(detail, netip.Addr{})
	e.log.Info("starting VM", "vm", id, "restart", rec.Restarts)
	bootCtx := withNarrator(ctx, sayer(ctx, pub, id, &rec, vmstate.PowerRunning, phase))
	err := e.cfg.Hyper.Boot(bootCtx, rec.Spec, e.cfg.St.SeedPath(id))
	switch {
	case err == nil:
		rec.BootedAt = e.cfg.Now()
		rec.FirstBoot = false
		e.save(id, rec)
		e.log.Info("VM booted", "vm", id)
		return e.observe(ctx, d, rec, "", phase)
	case ctx.Err() != nil:
		if e.ctx.Err() != nil || abandoned(ctx) != nil {
			return outcome{skip: true} // closing, or the next pass says what is true
		}
		// The pass's time ran out with the guest still coming up: it keeps
		// booting, and the next pass finds it. Not a failed run.
		e.log.Warn("boot still in progress when the pass timed out", "vm", id, "err", err)
		return outcome{row: newRow(id, rec, "", phase, err.Error(), SayWaitingForAddress)}
	case isHostFault(err):
		e.log.Warn("boot hit a host fault; trying again", "vm", id, "err", err)
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, phase, err.Error(), "host fault, will retry")}
	}
	e.log.Warn("boot failed", "vm", id, "err", err)
	// A guest that died booting is an exit like any other: counted and
	// described. Its reason says more than the boot's error does.
	reason := shortReason(err.Error())
	if x, ok := e.cfg.Hyper.Exited(ctx, id); ok {
		rec = e.recordExit(rec, x)
		reason = x.Reason
	}
	rec.LastError = err.Error()
	rec = e.failedRun(rec, reason)
	if rec.Failed {
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseFailed, rec.LastError, "")}
	}
	return outcome{
		row:    newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseRestarting, rec.LastError, restartWords(rec, rec.RestartAt.Sub(e.cfg.Now()))),
		wakeAt: rec.RestartAt,
	}
}

func plural(n int, word string) string {
	if n == 1 {
		return "1 " + word
	}
	return fmt.Sprintf("%d %ss", n, word)
}

// restartWords narrates a restart: why, when (wait > 0), which attempt:
// "qemu exited (signal 9); restarting in 40 s, attempt 3".
func restartWords(rec state.Record, wait time.Duration) string {
	when := "restarting"
	if wait > 0 {
		when += " in " + waitWords(wait)
	}
	return fmt.Sprintf("%s; %s, attempt %d", rec.RestartReason, when, rec.Restarts)
}

// failedRun counts a run of the guest that failed (it ended unasked, or
// its boot failed) against the restart budget and schedules the next
// restart, or fails the VM once the budget is spent. The record is saved.
func (e *Engine) failedRun(rec state.Record, reason string) state.Record {
	id := rec.Spec.ID
	rec.Restarts++
	rec.RestartReason = reason
	if rec.Restarts > e.cfg.MaxRestarts {
		rec.Failed = true
		rec.RestartAt = time.Time{}
		rec.LastError = fmt.Sprintf("%s; gave up after %s in a row", reason, plural(e.cfg.MaxRestarts, "restart"))
		e.log.Error("VM failed: its guest keeps failing", "vm", id, "restarts", e.cfg.MaxRestarts, "reason", reason)
	} else {
		wait := e.restartDelay(rec.Restarts)
		rec.RestartAt = e.cfg.Now().Add(wait)
		e.log.Warn("restarting the VM's guest", "vm", id, "attempt", rec.Restarts, "in", wait, "reason", reason)
	}
	e.save(id, rec)
	return rec
}

// recordExit counts and describes a guest that ended unasked. The record is
// saved, so the count only ever rises, across agent restarts too.
func (e *Engine) recordExit(rec state.Record, x GuestExit) state.Record {
	rec.Exits++
	rec.LastExit = &state.GuestExit{Reason: x.Reason, SerialTail: x.SerialTail, At: e.cfg.Now().UTC()}
	e.log.Warn("the VM's guest ended unasked", "vm", rec.Spec.ID, "reason", x.Reason, "exits", rec.Exits)
	e.save(rec.Spec.ID, rec)
	return rec
}

// noteExit records a guest's unasked exit, if the hypervisor saw one,
// without restarting anything.
func (e *Engine) noteExit(ctx context.Context, rec state.Record) state.Record {
	if x, ok := e.cfg.Hyper.Exited(ctx, rec.Spec.ID); ok {
		return e.recordExit(rec, x)
	}
	return rec
}

// forgetStableFailures clears the restart budget of a guest that has stayed
// up StableAfter since it was booted: failures that far apart are not a
// crash loop.
func (e *Engine) forgetStableFailures(rec state.Record) state.Record {
	if rec.Restarts == 0 || rec.BootedAt.IsZero() || e.cfg.Now().Sub(rec.BootedAt) < e.cfg.StableAfter {
		return rec
	}
	e.log.Info("the VM's guest has stayed up; its failed runs are forgotten", "vm", rec.Spec.ID, "restarts", rec.Restarts)
	rec.Restarts, rec.RestartAt, rec.RestartReason = 0, time.Time{}, ""
	e.save(rec.Spec.ID, rec)
	return rec
}

// shutDown powers a running VM off because it is wanted stopped, and says
// so: ACPI first, and the hypervisor narrates forcing it off after its
// grace.
func (e *Engine) shutDown(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, pub publisher) outcome {
	id := d.GetVmId()
	say := sayer(ctx, pub, id, &rec, vmstate.PowerRunning, vmstate.PhaseStopping)
	say(sayShuttingDown, netip.Addr{})
	var lastErr string
	if err := e.cfg.Hyper.Shutdown(withNarrator(ctx, say), id); err != nil {
		lastErr = err.Error()
		e.log.Warn("shutdown failed", "vm", id, "err", err)
	} else {
		e.log.Info("VM shut down", "vm", id)
	}
	return e.observe(ctx, d, rec, lastErr, e.bootPhase(rec))
}

// save writes the VM's record, logging a failure: the pass goes on with what
// it knows, and the next pass writes again.
func (e *Engine) save(id string, rec state.Record) {
	if err := e.cfg.St.SaveVM(id, rec); err != nil {
		e.log.Error("saving VM record", "vm", id, "err", err)
	}
}

// stop shuts the VM down if it is running and reports the power it ends in.
func (e *Engine) stop(ctx context.Context, id string) (running bool, lastErr string) {
	running, err := e.cfg.Hyper.Power(ctx, id)
	if err != nil {
		return false, err.Error()
	}
	if !running {
		return false, ""
	}
	if err := e.cfg.Hyper.Shutdown(ctx, id); err != nil {
		e.log.Warn("shutdown failed", "vm", id, "err", err)
		return true, err.Error()
	}
	running, err = e.cfg.Hyper.Power(ctx, id)
	if err != nil {
		return false, err.Error()
	}
	return running, ""
}
