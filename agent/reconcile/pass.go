package reconcile

import (
	"bytes"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/agent/permanent"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/sshcert"
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

// create builds a VM from nothing (or finishes an unfinished create): host
// key, preflight, create slot, image, root disk, seed, boot. It narrates each
// step through pub while its ctx is live.
func (e *Engine) create(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, ok bool, pub publisher) outcome {
	id := d.GetVmId()
	if ok && rec.Failed {
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseFailed, rec.LastError, "")}
	}
	if ctx.Err() != nil {
		// Never start an attempt on a dead context.
		return outcome{skip: true}
	}
	if wait := rec.NextAttemptAt.Sub(e.cfg.Now()); ok && wait > 0 {
		// The last attempt failed: the next waits out its backoff.
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseCreating, rec.LastError, e.attemptFailedWords(rec, wait)), wakeAt: rec.NextAttemptAt}
	}
	rec.Spec = specFrom(d) // an unfinished create follows the newest spec
	if rec.HostPubKey == "" {
		pubKey, privKey, err := state.NewHostKey()
		if err != nil {
			return e.failCreate(ctx, rec, err)
		}
		rec.HostPubKey, rec.HostPrivKey = pubKey, privKey
	}
	if err := e.cfg.St.SaveVM(id, rec); err != nil {
		// Without a durable record the host key would change on every try;
		// this is the store's fault, not the VM's, so no attempt is spent.
		e.log.Error("saving VM record", "vm", id, "err", err)
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseCreating, err.Error(), "cannot save the VM record")}
	}

	// say publishes the row this VM would report anyway (creating, not
	// running, no error) with what it is doing now. It carries the host key
	// because the key is level-triggered: a row without it would tell the
	// control plane to forget it. A pass whose ctx is done says nothing,
	// which keeps a download still draining on someone else's goroutine
	// from calling into a pass that gave up on it.
	//
	// measured is say with the step's numbers beside its words; a row
	// without them (say) has no progress, as the step it names has none.
	measured := func(detail string, p *eitriv1.Progress) {
		if pub == nil || ctx.Err() != nil {
			return
		}
		row := newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseCreating, "", detail)
		row.Progress = p
		pub(row)
	}
	say := func(detail string) { measured(detail, nil) }

	// Preflight comes before the slot queue and the download: a create that
	// can only be refused should cost nothing and wait for nothing.
	if err := e.cfg.Hyper.Preflight(ctx, rec.Spec); err != nil {
		return e.failCreate(ctx, rec, err)
	}
	// So is the admission check, and for the same reason: a VM this host
	// has no room for fails now, with the numbers, not after its download.
	if err := e.admitCreate(ctx, rec.Spec); err != nil {
		return e.failCreate(ctx, rec, err)
	}

	say(sayWaitingForSlot)
	release, err := e.acquireCreateSlot(ctx)
	if err != nil {
		return e.failCreate(ctx, rec, err)
	}
	defer release() // held through Boot, which is I/O heavy in the guest
	fail := func(err error) outcome {
		release() // the next queued create need not wait for the cleanup
		return e.failCreate(ctx, rec, err)
	}

	say(sayDownloading)
	base, releaseImage, err := e.cfg.Images(ctx, rec.Spec.ImageURL, rec.Spec.ImageSHA256, func(done, total int64) {
		measured(downloadDetail(done, total), downloadProgress(done, total))
	})
	if err != nil {
		return fail(err)
	}
	// Released as soon as the root disk holds the image (it keeps its base
	// alive itself) or could not be made, so the cache may evict it.
	if ctx.Err() != nil {
		releaseImage()
		return fail(ctx.Err())
	}
	say(sayPreparingDisk)
	err = e.cfg.Hyper.PrepareRootDisk(ctx, rec.Spec, base)
	releaseImage()
	if err != nil {
		return fail(err)
	}

	seedSays := sayBuildingSeed
	if rec.HostCert == "" && e.cfg.SignHostKey != nil {
		say(sayCertifying)
		if cert, err := e.certifyHostKey(ctx, id, rec.HostPubKey); err != nil {
			// The guest is still reachable with its key pinned; only the
			// CA shortcut is missing, which is no reason to fail it. The
			// seed step says so, so it stays on screen for a while.
			e.log.Warn("SSH host key not certified", "vm", id, "err", err)
			seedSays += "; " + sayUncertified + err.Error()
		} else {
			rec.HostCert = cert
			if err := e.cfg.St.SaveVM(id, rec); err != nil {
				e.log.Error("saving VM record", "vm", id, "err", err)
			}
		}
	}

	say(seedSays)
	seedPath := e.cfg.St.SeedPath(id)
	if err := e.cfg.Seed(seedPath, SeedParams{
		InstanceID:        id,
		Hostname:          rec.Spec.Name,
		SSHAuthorizedKey:  rec.Spec.SSHAuthorizedKey,
		HostPrivKey:       rec.HostPrivKey,
		HostPubKey:        rec.HostPubKey,
		LoginUser:         e.cfg.LoginUser,
		TrustedUserCAKeys: d.GetSshUserCaKeys(),
		UserCertPrincipal: sshcert.Principal(e.cfg.LoginUser, id),
		HostCertificate:   rec.HostCert,
	}); err != nil {
		return fail(err)
	}
	rec.LoginUser = e.cfg.LoginUser

	if wantRunning(d) {
		say(sayBooting)
		if err := e.cfg.Hyper.Boot(withNarrator(ctx, sayer(ctx, pub, id, &rec, vmstate.PowerRunning, vmstate.PhaseCreating)), rec.Spec, seedPath); err != nil {
			// A guest that died booting is an exit like any other: counted
			// and described, besides failing the attempt.
			rec = e.noteExit(ctx, rec)
			return fail(err)
		}
		rec.BootedAt = e.cfg.Now()
		rec.FirstBoot = true
	}

	// Disk and seed are complete: from here on this VM is converged, never
	// rebuilt.
	rec.BootID = newBootID()
	rec.CreateAttempts = 0
	rec.NextAttemptAt = time.Time{}
	rec.LastError = ""
	if err := e.cfg.St.SaveVM(id, rec); err != nil {
		e.log.Error("saving created VM record", "vm", id, "err", err)
	}
	e.log.Info("VM created", "vm", id)
	return e.observe(ctx, d, rec, "", vmstate.PhaseCreating)
}

// certifyHostKey asks the control plane for the guest's host certificate,
// for no longer than SignTimeout.
func (e *Engine) certifyHostKey(ctx context.Context, id, pub string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.SignTimeout)
	defer cancel()
	line, err := e.cfg.SignHostKey(ctx, id, pub)
	if err != nil {
		return "", err
	}
	line = strings.TrimSpace(line)
	// A certificate the seed would refuse must not fail the VM: it is
	// dropped here, and the guest boots uncertified.
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line))
	if err != nil {
		return "", fmt.Errorf("the control plane's host certificate: %w", err)
	}
	want, _, _, _, err := ssh.ParseAuthorizedKey([]byte(pub))
	if err != nil {
		return "", err
	}
	cert, ok := k.(*ssh.Certificate)
	if !ok || cert.CertType != ssh.HostCert || !bytes.Equal(cert.Key.Marshal(), want.Marshal()) || strings.ContainsAny(line, "\r\n") {
		return "", errors.New("the control plane's host certificate is not one for this guest's host key")
	}
	return line, nil
}

// failCreate settles a failed create attempt. A create the desired state
// stopped wanting is abandoned, not failed. A failure of the pass's own
// context (VMTimeout, or shutdown) or a host fault is refunded: neither is
// the VM's fault. A permanent error fails at once; anything else spends one
// attempt.
func (e *Engine) failCreate(ctx context.Context, rec state.Record, err error) outcome {
	id := rec.Spec.ID
	if e.ctx.Err() != nil {
		return outcome{skip: true} // the engine is closing; record nothing
	}
	if why := abandoned(ctx); why != nil {
		return e.abandonCreate(id, rec, why)
	}
	rec.LastError = err.Error()
	detail := ""
	switch {
	case ctx.Err() != nil:
		detail = "timed out, will retry"
		e.log.Warn("create timed out; attempt refunded", "vm", id, "err", err)
	case isHostFault(err):
		detail = "host fault, will retry"
		e.log.Warn("create hit a host fault; attempt refunded", "vm", id, "err", err)
	default:
		rec.CreateAttempts++
		if permanent.Is(err) || rec.CreateAttempts >= e.cfg.MaxCreateAttempts {
			rec.Failed = true
			e.forgetAdmitted(id)
			e.log.Error("create failed", "vm", id, "attempts", rec.CreateAttempts, "err", err)
		} else {
			wait := e.backoff(rec.CreateAttempts)
			rec.NextAttemptAt = e.cfg.Now().Add(wait)
			detail = e.attemptFailedWords(rec, wait)
			e.log.Warn("create attempt failed; backing off", "vm", id, "attempts", rec.CreateAttempts, "retry_in", wait, "err", err)
		}
	}
	if serr := e.cfg.St.SaveVM(id, rec); serr != nil {
		e.log.Error("saving VM record", "vm", id, "err", serr)
	}
	if rec.Failed {
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseFailed, rec.LastError, "")}
	}
	return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseCreating, rec.LastError, detail), wakeAt: rec.NextAttemptAt}
}

// abandonCreate ends a create that newer desired state no longer wants,
// recording nothing against the VM (no attempt spent, no error): the user
// changed their mind, nothing went wrong. Its row is the one the new state
// calls for, without narration: the pass is over.
//
// A stopped VM keeps whatever is finished (an overlay disk is reused when it
// is started) and builds the rest only when it is wanted running again:
// starting the create over for a VM nobody wants running would hold the slot
// the stop was meant to free.
//
// A deleted or unnamed VM's create never finished, so nothing it made is
// worth keeping: disk, seed, tap, lease and any QEMU a cut-short boot left
// go now. The record stays, so the VM takes its usual way out (deleting
// until destroy_at, or quarantine) and a restore builds it afresh.
func (e *Engine) abandonCreate(id string, rec state.Record, why error) outcome {
	e.log.Info("create cancelled", "vm", id, "why", why)
	if errors.Is(why, errStopped) {
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseStopped, "", ""), holdCreate: true}
	}
	ctx, cancel := e.passContext(e.ctx)
	defer cancel()
	if err := e.cfg.Hyper.Destroy(ctx, id); err != nil {
		// Whatever is left goes when the VM is destroyed.
		e.log.Warn("removing what a cancelled create made", "vm", id, "err", err)
	}
	if errors.Is(why, errUnnamed) {
		return outcome{} // the next pass quarantines it
	}
	return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseDeleting, "", "")}
}

// keepUnbuilt reports a stopped VM whose create a stop cancelled. A boot the
// stop cut short may have left its guest running; it is shut down.
func (e *Engine) keepUnbuilt(ctx context.Context, id string, rec state.Record) outcome {
	running, lastErr := e.stop(ctx, id)
	return outcome{row: newRow(id, rec, powerWord(running), vmstate.PhaseStopped, lastErr, "")}
}

// acquireCreateSlot waits for a create slot. release may be called more
// than once; only the first gives the slot back.
func (e *Engine) acquireCreateSlot(ctx context.Context) (release func(), err error) {
	select {
	case e.slots <- struct{}{}:
		return sync.OnceFunc(func() { <-e.slots }), nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
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

// observe reads power and address and builds the VM's settled row.
// waitPhase is its phase while it runs without an address (creating, or
// starting).
func (e *Engine) observe(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, lastErr, waitPhase string) outcome {
	running, err := e.cfg.Hyper.Power(ctx, d.GetVmId())
	if err != nil {
		return outcome{row: unknownPowerRow(d.GetVmId(), rec, nil, err)}
	}
	return e.observeKnown(ctx, d, rec, running, lastErr, waitPhase)
}

// observeKnown builds the row for a guest whose power is known. Ready needs
// an address the guest took in its current boot: an address remembered
// from an earlier boot says nothing about whether this one came up.
func (e *Engine) observeKnown(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, running bool, lastErr, waitPhase string) outcome {
	id := d.GetVmId()
	rec, leased := e.refreshAddress(ctx, id, rec)
	if !running {
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseStopped, lastErr, "")}
	}
	if !leased {
		return outcome{row: newRow(id, rec, vmstate.PowerRunning, waitPhase, lastErr, SayWaitingForAddress)}
	}
	signal, ready := e.cfg.Hyper.Ready(ctx, id)
	if !ready {
		return outcome{row: newRow(id, rec, vmstate.PowerRunning, waitPhase, lastErr, sayWaitingForReady)}
	}
	if rec.FirstBoot {
		rec.FirstBoot = false
		e.save(id, rec)
	}
	row := newRow(id, rec, vmstate.PowerRunning, vmstate.PhaseReady, lastErr, "")
	row.ReadySignal = signal
	return outcome{row: row}
}

// refreshAddress records a newly learned guest address; leased says the
// guest holds one now.
func (e *Engine) refreshAddress(ctx context.Context, id string, rec state.Record) (state.Record, bool) {
	addr, ok := e.cfg.Hyper.Address(ctx, id)
	if !ok || !addr.IsValid() {
		return rec, false
	}
	if addr.String() == rec.IP {
		return rec, true
	}
	rec.IP = addr.String()
	if err := e.cfg.St.SaveVM(id, rec); err != nil {
		e.log.Error("saving VM address", "vm", id, "err", err)
	}
	return rec, true
}

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

// hold keeps a VM the agent will not take the desired state's word on (no
// snapshot names it, or names it with an older record than this host
// applied) as it was: a guest last wanted running stays running (and is
// booted again if it crashed), nothing is stopped and nothing destroyed. It
// is reported held, with its record, until an admin adopts it (a newer
// version) or destroys it. stale: the desired state does name it, so it
// keeps its row too.
func (e *Engine) hold(ctx context.Context, id string, rec state.Record, ok, stale bool, why string) outcome {
	if !ok {
		return outcome{gone: true}
	}
	if rec.QuarantinedAt.IsZero() {
		rec.QuarantinedAt = e.cfg.Now()
		if err := e.cfg.St.SaveVM(id, rec); err != nil {
			e.log.Error("saving held VM record", "vm", id, "err", err)
		}
		e.log.Warn("holding the VM as it is until an admin adopts or destroys it", "vm", id, "why", why)
	}
	power := ""
	running, err := e.cfg.Hyper.Power(ctx, id)
	if err == nil {
		if !running && rec.Power == vmstate.PowerRunning && !rec.Deleted && rec.BootID != "" {
			if err := e.cfg.Hyper.Boot(ctx, rec.Spec, e.cfg.St.SeedPath(id)); err != nil {
				e.log.Warn("booting a held VM failed", "vm", id, "err", err)
			} else if running, err = e.cfg.Hyper.Power(ctx, id); err != nil {
				running = false
			}
		}
		power = powerWord(running)
	}
	spec, err := json.Marshal(rec.Spec)
	if err != nil {
		spec = nil
	}
	held := rec.Power
	if held == "" { // a record from before it was kept: as it is now
		held = power
	}
	out := outcome{quar: &eitriv1.QuarantinedVM{
		VmId:       id,
		Name:       rec.Spec.Name,
		VmspecJson: spec,
		Held: &eitriv1.VMDesired{
			VmId: id, Name: rec.Spec.Name, ImageUrl: rec.Spec.ImageURL, ImageSha256: rec.Spec.ImageSHA256,
			Vcpus: rec.Spec.VCPUs, MemMb: rec.Spec.MemMB, DiskGb: rec.Spec.DiskGB, PowerState: held,
			Deleted: rec.Deleted, SshAuthorizedKey: rec.Spec.SSHAuthorizedKey, Owner: rec.Spec.Owner, Version: rec.Version,
		},
		Power:     power,
		Reason:    why,
		Stale:     stale,
		SinceUnix: rec.QuarantinedAt.Unix(),
	}}
	if stale {
		phase := vmstate.PhaseStopped
		switch {
		case rec.Deleted:
			phase = vmstate.PhaseDeleting
		case rec.BootID == "":
			phase = vmstate.PhaseCreating
		case running && rec.IP != "":
			phase = vmstate.PhaseReady
		case running:
			phase = vmstate.PhaseCreating
		}
		out.row = newRow(id, rec, power, phase, "", "")
	}
	return out
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

// newRow builds a report row. Every row carries the guest's public host key
// for as long as the VM exists.
func newRow(id string, rec state.Record, power, phase, lastErr, detail string) *eitriv1.ActualVM {
	row := &eitriv1.ActualVM{
		VmId:            id,
		Power:           power,
		Phase:           phase,
		Ip:              rec.IP,
		LastError:       lastErr,
		SshHostPubkey:   rec.HostPubKey,
		StatusDetail:    detail,
		Retry:           rec.Retry,
		UnexpectedExits: uint32(rec.Exits),
		LoginUser:       rec.LoginUser,
	}
	if x := rec.LastExit; x != nil {
		row.LastExit = &eitriv1.GuestExit{Reason: x.Reason, SerialTail: x.SerialTail, AtUnix: x.At.Unix()}
	}
	return row
}

// unknownPowerRow is the row for a VM whose power could not be read: the last
// known power and phase stand (absent if none was known), with the error.
func unknownPowerRow(id string, rec state.Record, prev *eitriv1.ActualVM, err error) *eitriv1.ActualVM {
	power, phase := "", vmstate.PhaseStopped
	if prev != nil && prev.GetPhase() != "" {
		power, phase = prev.GetPower(), prev.GetPhase()
	}
	detail, progress := "", (*eitriv1.Progress)(nil)
	if phase == vmstate.PhaseCreating {
		detail, progress = prev.GetStatusDetail(), prev.GetProgress()
	}
	row := newRow(id, rec, power, phase, err.Error(), detail)
	row.Progress = progress // published rows are never modified: sharing is safe
	return row
}

func powerWord(running bool) string {
	if running {
		return vmstate.PowerRunning
	}
	return vmstate.PowerStopped
}

func wantRunning(d *eitriv1.VMDesired) bool { return d.GetPowerState() == vmstate.PowerRunning }

func specFrom(d *eitriv1.VMDesired) state.VMSpec {
	return state.VMSpec{
		ID:               d.GetVmId(),
		Name:             d.GetName(),
		ImageURL:         d.GetImageUrl(),
		ImageSHA256:      d.GetImageSha256(),
		VCPUs:            d.GetVcpus(),
		MemMB:            d.GetMemMb(),
		DiskGB:           d.GetDiskGb(),
		SSHAuthorizedKey: d.GetSshAuthorizedKey(),
		Owner:            d.GetOwner(),
	}
}

func newBootID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// downloadDetail words a download's progress. Both numbers share one unit,
// chosen from the larger, so they read as a fraction; with no known total
// only the part done is said.
func downloadDetail(done, total int64) string {
	div, unit := sizeUnit(max(done, total))
	if total <= 0 {
		return fmt.Sprintf("%s %.1f %s", sayDownloading, float64(done)/div, unit)
	}
	return fmt.Sprintf("%s %.1f/%.1f %s", sayDownloading, float64(done)/div, float64(total)/div, unit)
}

// stepDownload is Progress.step while the VM's image is fetched.
const stepDownload = "download"

// downloadProgress is the download's numbers as the row carries them, from
// the same report downloadDetail words: total is left unset when the server
// gave no length (the cache says -1), never sent as 0.
func downloadProgress(done, total int64) *eitriv1.Progress {
	p := &eitriv1.Progress{Step: stepDownload, DoneBytes: uint64(max(done, 0))}
	if total > 0 {
		t := uint64(total)
		p.TotalBytes = &t
	}
	return p
}

// sizeUnit is GiB from one GiB up, else MiB: images are never small enough
// for smaller units to read as anything but a stall.
func sizeUnit(n int64) (float64, string) {
	if n >= 1<<30 {
		return 1 << 30, "GiB"
	}
	return 1 << 20, "MiB"
}
