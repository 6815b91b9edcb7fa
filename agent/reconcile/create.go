package reconcile

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"time"

	"github.com/a73x/eitri/agent/permanent"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// create builds a VM from nothing (or finishes an unfinished create) by
// running createSteps in order, then records it created. Each step says its
// word as it begins, through pub while ctx is live; the first step that
// fails ends the attempt (failCreate), and the steps after it do not run.
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

	c := &createRun{e: e, ctx: ctx, d: d, id: id, rec: rec, pub: pub}
	defer c.letGo() // the slot is held through Boot, which is I/O heavy in the guest
	for _, s := range createSteps {
		if s.when != nil && !s.when(c) {
			continue
		}
		if says := s.word(c); says != "" {
			c.say(says + c.takeNote())
		}
		if err := s.run(c); err != nil {
			return c.fail(err)
		}
	}
	return c.created()
}

// createStep is one step of a create: its name (for people and tests), the
// word a VM's row says while it runs ("" says nothing new: the steps before
// the create slot are quick, and a create they refuse should not look
// started), sayFor when that word depends on the create (then says is the
// usual one), and, when it does not always run, when it does.
type createStep struct {
	name   string
	says   string
	sayFor func(*createRun) string
	when   func(*createRun) bool
	run    func(*createRun) error
}

// word is what s says as it begins for c.
func (s createStep) word(c *createRun) string {
	if s.sayFor != nil {
		return s.sayFor(c)
	}
	return s.says
}

// createRun is one create attempt, shared by its steps: the record they
// build up and what the attempt holds until it ends.
type createRun struct {
	e   *Engine
	ctx context.Context
	d   *eitriv1.VMDesired
	id  string
	rec state.Record
	pub publisher

	// releaseSlot gives back the create slot (nil until one is held; safe
	// to call more than once). base is the cached image the root disk is
	// made from, pinned in the cache until unpinImage.
	releaseSlot  func()
	base         string
	releaseImage func()

	// note is what a step that went on past a problem wants said: it rides
	// on the next step's word, so it stays on screen for a while.
	note string
}

// measured publishes the row this VM would report anyway (creating, not
// running, no error) with what it is doing now, and the step's numbers
// beside its words. It carries the host key because the key is
// level-triggered: a row without it would tell the control plane to forget
// it. An attempt whose ctx is done says nothing, which keeps a download
// still draining on someone else's goroutine from calling into a pass that
// gave up on it.
func (c *createRun) measured(detail string, p *eitriv1.Progress) {
	if c.pub == nil || c.ctx.Err() != nil {
		return
	}
	row := newRow(c.id, c.rec, vmstate.PowerStopped, vmstate.PhaseCreating, "", detail)
	row.Progress = p
	c.pub(row)
}

// say is measured without numbers: the step it names has no progress.
func (c *createRun) say(detail string) { c.measured(detail, nil) }

func (c *createRun) takeNote() string {
	n := c.note
	c.note = ""
	return n
}

// unpinImage lets the cache evict the image again; at most once per pin.
func (c *createRun) unpinImage() {
	if c.releaseImage != nil {
		c.releaseImage()
		c.releaseImage = nil
	}
}

// letGo gives back what the attempt holds: the image, then the slot.
func (c *createRun) letGo() {
	c.unpinImage()
	if c.releaseSlot != nil {
		c.releaseSlot()
	}
}

// unsavedRecord is the store failing to keep the VM's record: the store's
// fault, not the VM's, so the attempt ends without spending one.
type unsavedRecord struct{ err error }

func (u unsavedRecord) Error() string { return u.err.Error() }
func (u unsavedRecord) Unwrap() error { return u.err }

// fail ends the attempt on a step's error.
func (c *createRun) fail(err error) outcome {
	var unsaved unsavedRecord
	if errors.As(err, &unsaved) {
		return outcome{row: newRow(c.id, c.rec, vmstate.PowerStopped, vmstate.PhaseCreating, err.Error(), "cannot save the VM record")}
	}
	c.letGo() // the next queued create need not wait for the cleanup
	return c.e.failCreate(c.ctx, c.rec, err)
}

// created records the VM created once every step is done. Disk and seed are
// complete: from here on this VM is converged, never rebuilt.
func (c *createRun) created() outcome {
	c.rec.BootID = newBootID()
	c.rec.CreateAttempts = 0
	c.rec.NextAttemptAt = time.Time{}
	c.rec.LastError = ""
	if err := c.e.cfg.St.SaveVM(c.id, c.rec); err != nil {
		c.e.log.Error("saving created VM record", "vm", c.id, "err", err)
	}
	c.e.log.Info("VM created", "vm", c.id)
	return c.e.observe(c.ctx, c.d, c.rec, "", vmstate.PhaseCreating)
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
		Readiness:        readinessOf(d.GetReadiness()),
	}
}

// readinessOf is the host's word for how the guest is judged ready; one
// this agent does not know is the default.
func readinessOf(r eitriv1.ImageReadiness) state.Readiness {
	switch r {
	case eitriv1.ImageReadiness_IMAGE_READINESS_CLOUD_INIT:
		return state.ReadinessCloudInit
	case eitriv1.ImageReadiness_IMAGE_READINESS_SSH:
		return state.ReadinessSSH
	case eitriv1.ImageReadiness_IMAGE_READINESS_ADDRESS:
		return state.ReadinessAddress
	}
	return state.ReadinessDefault
}

func newBootID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
