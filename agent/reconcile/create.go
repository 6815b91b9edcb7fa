package reconcile

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/a73x/eitri/agent/permanent"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/sshcert"
	"github.com/a73x/eitri/wire/vmstate"
)

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
