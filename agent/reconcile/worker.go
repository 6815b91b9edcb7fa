package reconcile

import (
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// worker owns one VM: it alone runs passes for it, one at a time, always
// against the newest desired state it has been handed.
type worker struct {
	eng  *Engine
	id   string
	kick chan struct{} // capacity 1: "desired changed, run a pass"

	mu sync.Mutex
	// desired is the newest desired state; nil means no snapshot names this
	// VM (quarantine).
	desired *eitriv1.VMDesired
	// seq rises whenever desired changes; retire uses it to notice a
	// snapshot that landed while a pass was deciding the VM was gone.
	seq uint64
	// pending: a kick has been sent that no pass has picked up yet.
	pending bool
	// busy: a pass is in flight (with mu released).
	busy bool
	// retiring: the last pass found the VM gone and the engine has not yet
	// decided whether to retire the worker (it is not idle until then).
	retiring bool
	// gen names the pass in flight; a mid-pass publish must carry it.
	gen uint64
	// passWants is the desired state the pass in flight runs against, and
	// cancelPass cancels it (nil when no pass is in flight): newer desired
	// state that no longer wants what the pass is doing cuts it short.
	passWants  *eitriv1.VMDesired
	cancelPass context.CancelCauseFunc
	// holdCreate: a stop cancelled this VM's create, so it stays unbuilt
	// until it is wanted running again. Memory only: an agent restart
	// forgets it and builds the VM as it would one created stopped.
	holdCreate bool
	// row and quar are this VM's contribution to the report. Published rows
	// are never modified, only replaced.
	row     *eitriv1.ActualVM
	quar    *eitriv1.QuarantinedVM
	retired bool
	passes  uint64 // passes started, for tests and debugging
}

func newWorker(e *Engine, id string) *worker {
	return &worker{eng: e, id: id, kick: make(chan struct{}, 1)}
}

// setDesired hands the worker new desired state and wakes it if that state
// differs from what it had. The first call always wakes it.
func (w *worker) setDesired(d *eitriv1.VMDesired) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seq > 0 && proto.Equal(w.desired, d) && (w.desired == nil) == (d == nil) {
		return
	}
	w.desired = d
	w.seq++
	w.pending = true
	if w.busy && w.cancelPass != nil {
		if why := supersedes(w.passWants, d); why != nil {
			w.eng.log.Info("cutting the VM's pass short", "vm", w.id, "why", why)
			w.cancelPass(why)
			w.cancelPass = nil
		}
	}
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

func (w *worker) run() {
	defer w.eng.wg.Done()
	tick := time.NewTicker(w.eng.cfg.ResyncInterval)
	defer tick.Stop()
	// wake ends a backoff a pass asked for (outcome.wakeAt), so a retry
	// happens when it was said to, not at the next resync.
	wake := time.NewTimer(time.Hour)
	wake.Stop()
	defer wake.Stop()
	for {
		select {
		case <-w.eng.ctx.Done():
			return
		case <-w.kick:
		case <-tick.C:
		case <-wake.C:
		}

		ctx, cancel := context.WithCancelCause(w.eng.ctx)
		w.mu.Lock()
		d, seq, prev := w.desired, w.seq, w.row
		w.pending = false
		w.busy = true
		w.gen++
		w.passes++
		gen := w.gen
		w.passWants, w.cancelPass = d, cancel
		if wantRunning(d) {
			w.holdCreate = false
		}
		hold := w.holdCreate
		w.mu.Unlock()

		// The pass runs with w.mu released: Fill and Apply never wait on it.
		out := w.eng.pass(ctx, w.id, d, prev, hold, func(row *eitriv1.ActualVM) { w.publish(gen, row) })
		cancel(nil)

		w.mu.Lock()
		changed := false
		if !out.skip {
			changed = !rowsEqual(w.row, out.row) || !proto.Equal(w.quar, out.quar) || (w.quar == nil) != (out.quar == nil)
			w.row, w.quar = out.row, out.quar
		}
		if out.holdCreate {
			w.holdCreate = true
		}
		wake.Stop()
		if d := out.wakeAt.Sub(w.eng.cfg.Now()); !out.wakeAt.IsZero() && d > 0 {
			wake.Reset(d) // no wait left: the next resync is soon enough
		}
		// Clearing busy in the same critical section that lands the result
		// closes this pass to late publishes.
		w.busy = false
		w.retiring = out.gone
		w.passWants, w.cancelPass = nil, nil
		w.mu.Unlock()
		if changed {
			w.eng.notify()
		}

		if out.gone && w.eng.retire(w, seq, out.destroyed) {
			return
		}
	}
}

// publish lands a row from inside a pass, so the report can describe work
// that has not finished. It lands only while the pass that produced it (gen)
// is still the one in flight: narration can come from goroutines the pass
// does not own (a shared image download), and a line arriving after its pass
// ended, or from an older pass while a newer runs, must not overwrite the
// settled row. Narration is commentary, never state.
func (w *worker) publish(gen uint64, row *eitriv1.ActualVM) {
	w.mu.Lock()
	if !w.busy || gen != w.gen || w.retired {
		w.mu.Unlock()
		return
	}
	changed := !rowsEqual(w.row, row)
	w.row = row
	w.mu.Unlock()
	if changed {
		w.eng.notify()
	}
}

// Why a pass in flight stopped being wanted. Each is the cause its context is
// cancelled with, so the pass can tell it from a timeout or a shutdown.
var (
	errDeleted = errors.New("the VM was deleted")
	errUnnamed = errors.New("the desired state no longer names the VM")
	errStopped = errors.New("the VM was stopped")
)

// supersedes says why newer desired state makes the work of a pass running
// toward old unwanted, or nil when it does not. Only a step down counts (gone,
// deleted, stopped): a change that wants as much or more (a start, a
// restore, a new owner) lets the pass finish, and the pass after it does the
// rest.
func supersedes(old, newer *eitriv1.VMDesired) error {
	if old == nil || old.GetDeleted() {
		return nil // quarantine and delete passes only ever take things down
	}
	switch {
	case newer == nil:
		return errUnnamed
	case newer.GetDeleted():
		return errDeleted
	case wantRunning(old) && !wantRunning(newer):
		return errStopped
	}
	return nil
}

// abandoned is why ctx was cut short by newer desired state, or nil when it
// was not (it is live, timed out, or the engine is closing).
func abandoned(ctx context.Context) error {
	if ctx.Err() == nil {
		return nil
	}
	switch cause := context.Cause(ctx); cause {
	case errDeleted, errUnnamed, errStopped:
		return cause
	}
	return nil
}

// idle reports that no pass is running or queued and no retirement is
// being decided (tests poll it).
func (w *worker) idle() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return !w.busy && !w.pending && !w.retiring
}

// passContext bounds one pass by VMTimeout.
func (e *Engine) passContext(parent context.Context) (context.Context, context.CancelFunc) {
	if e.cfg.VMTimeout > 0 {
		return context.WithTimeout(parent, e.cfg.VMTimeout)
	}
	return context.WithCancel(parent)
}
