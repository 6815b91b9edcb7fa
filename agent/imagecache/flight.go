package imagecache

import (
	"context"
	"errors"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/a73x/eitri/agent/permanent"
)

// Why a flight's context is cancelled. Only errUnwanted discards what the
// download fetched; the others keep it for a resume.
var (
	errUnwanted   = errors.New("no caller wants the image any more")
	errUnattended = errors.New("no caller came back for the download")
)

// ErrClosed is returned by Ensure once Close has been called.
var ErrClosed = errors.New("the image cache is closed")

// flight is one download+decode of one image, shared by every Ensure caller
// for that digest that arrives while it runs.
type flight struct {
	done chan struct{}
	path string
	err  error
	// after is the flight this one replaced, still winding down: the two
	// share the partial download file, so this one starts once that is done.
	after <-chan struct{}

	cancel context.CancelCauseFunc

	// Guarded by Cache.mu.
	waiters  []*waiter
	stopping bool // cancelled: a new caller starts a new flight after it
	// parkGen names the current unattended spell; a timer from an earlier
	// one finds it changed and does nothing.
	parkGen  int
	parkTime *time.Timer

	// One waiter at a time hears progress: the one that started the
	// flight, or, once it has gone, the next waiting that asked for it, or
	// the first to join a flight nobody hears. pos is where the download
	// was last seen, told to a new hearer at once, so narration goes on
	// from where it was instead of from nothing.
	pmu    sync.Mutex
	hearer *waiter
	pos    [2]int64
	known  bool
}

type waiter struct {
	progress func(done, total int64)
	gone     bool // guarded by flight.pmu
}

func (f *flight) report(done, total int64) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	f.pos, f.known = [2]int64{done, total}, true
	if f.hearer != nil {
		f.hearer.progress(done, total)
	}
}

// listen makes w the hearer if nobody is and w asked for progress.
func (f *flight) listen(w *waiter) {
	if w.progress == nil {
		return
	}
	f.pmu.Lock()
	defer f.pmu.Unlock()
	if f.hearer != nil || w.gone {
		return
	}
	f.hearer = w
	if f.known {
		w.progress(f.pos[0], f.pos[1])
	}
}

// leave silences w for good (however it leaves, its callback must not fire
// afterwards: it may publish into a pass that is no longer running) and, if
// it was the hearer, hands progress to next.
func (f *flight) leave(w, next *waiter) {
	f.pmu.Lock()
	w.gone = true
	wasHearer := f.hearer == w
	if wasHearer {
		f.hearer = nil
	}
	f.pmu.Unlock()
	if wasHearer && next != nil {
		f.listen(next)
	}
}

// join adds a waiter to f. c.mu held.
func (f *flight) join(progress func(done, total int64)) *waiter {
	w := &waiter{progress: progress}
	f.waiters = append(f.waiters, w)
	f.parkGen++ // whatever unattended spell there was is over
	if f.parkTime != nil {
		f.parkTime.Stop()
		f.parkTime = nil
	}
	return w
}

// drop removes w from f and returns the waiter progress should pass to.
// c.mu held.
func (f *flight) drop(w *waiter) (next *waiter) {
	f.waiters = slices.DeleteFunc(f.waiters, func(x *waiter) bool { return x == w })
	for _, x := range f.waiters {
		if x.progress != nil {
			return x
		}
	}
	return nil
}

// Ensure returns the path of the raw image whose served bytes have the given
// sha256 (64 lowercase hex digits), downloading and converting it from url if
// it is not cached yet.
//
// Concurrent calls for one digest share one download, which runs on a
// context detached from every caller. A caller whose ctx ends stops waiting
// and gets ctx's error; the download goes on for the others. When the last
// one leaves, how it left decides:
//   - its ctx's deadline passed (it ran out of time, it did not change its
//     mind): the download goes on alone for the unattended timeout, so a
//     retry that calls Ensure again picks it up where it is, or finds the
//     image cached; then it stops, keeping what it fetched;
//   - it was cancelled in any other way: nobody wants the image, so the
//     download stops and leaves nothing behind, and that caller returns
//     once it has.
//
// A download that fails, or stops unattended, keeps what it fetched, and the
// next Ensure resumes it (HTTP Range, validated by ETag or Last-Modified
// when the server gives them; a server that sends the whole image instead
// gets it started over, and the log says why).
//
// progress, if non-nil, is told how far the download has come: once when
// the server's answer arrives (so the total is known before the first step),
// then at most once per progress step or progress interval, whichever comes
// first, with total = the image's declared length or -1. One
// caller at a time hears it: the one that started the download, or, after it
// leaves, the next waiting caller that passed a progress func, or the first
// to join a download nobody hears, who is told at once where it is. A resumed
// download reports from where it was; done goes down only when the download
// starts over. Cache hits report nothing. It is called from the copy loop,
// so it must not block.
//
// Errors that retrying cannot fix are marked so (permanent.Is).
func (c *Cache) Ensure(ctx context.Context, url, sha256 string, progress func(done, total int64)) (string, error) {
	// Checked first: the digest becomes a file name, so a bad one must never
	// reach the disk, the network or the flight table.
	if !validDigest(sha256) {
		return "", permanent.Errorf("%w: %q: want 64 lowercase hex digits", ErrInvalidDigest, sha256)
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	c.sweepOnce.Do(c.sweepPartials)

	final := c.Path(sha256)
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return "", ErrClosed
	}
	var after <-chan struct{}
	if f, ok := c.flights[sha256]; ok {
		if !f.stopping {
			w := f.join(progress)
			c.mu.Unlock()
			f.listen(w)
			return c.wait(ctx, sha256, f, w)
		}
		after = f.done
	} else if c.verified[sha256] {
		if _, err := os.Stat(final); err == nil {
			// Hit: refresh recency under the lock so eviction sees it.
			now := time.Now()
			if err := os.Chtimes(final, now, now); err != nil {
				c.log.Warn("imagecache: touch", "path", final, "err", err)
			}
			c.mu.Unlock()
			return final, nil
		}
		delete(c.verified, sha256)
	}
	fctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	f := &flight{done: make(chan struct{}), after: after, cancel: cancel}
	w := f.join(progress)
	c.flights[sha256] = f
	c.mu.Unlock()
	f.listen(w)

	go func() {
		var path string
		var err error
		if f.after != nil {
			<-f.after // quick: it was cancelled
		}
		if err = context.Cause(fctx); err != nil {
			if err == errUnwanted {
				c.removePartial(sha256)
			}
		} else {
			path, err = c.populate(fctx, url, sha256, f.report)
		}
		cancel(nil)
		c.mu.Lock()
		if c.flights[sha256] == f {
			delete(c.flights, sha256)
		}
		if f.parkTime != nil {
			f.parkTime.Stop()
		}
		f.path, f.err = path, err
		c.mu.Unlock()
		close(f.done)
	}()
	return c.wait(ctx, sha256, f, w)
}

func (c *Cache) wait(ctx context.Context, sha string, f *flight, w *waiter) (string, error) {
	select {
	case <-f.done:
		f.leave(w, nil)
		return f.path, f.err
	case <-ctx.Done():
	}
	select {
	case <-f.done: // finished at the same moment: take the result
		f.leave(w, nil)
		return f.path, f.err
	default:
	}
	c.mu.Lock()
	next := f.drop(w)
	last := len(f.waiters) == 0 && !f.stopping
	stop := last
	if last && c.unattended > 0 && errors.Is(context.Cause(ctx), context.DeadlineExceeded) {
		// Out of time, not out of interest: the download goes on alone for
		// a while, for the retry to pick up.
		stop = false
		gen := f.parkGen
		f.parkTime = time.AfterFunc(c.unattended, func() { c.parkExpired(sha, f, gen) })
	}
	if stop {
		// Nobody wants it any more. A later caller starts a new flight
		// (after this one has wound down: they share the partial file).
		f.stopping = true
		f.cancel(errUnwanted)
	}
	c.mu.Unlock()
	f.leave(w, next)
	if stop {
		// The last caller out waits for the work to wind down, so that when
		// it returns the download has stopped and its files are gone (a
		// cancelled create frees its slot with nothing of it left behind).
		// Every step of populate honours fctx, so this wait is short.
		<-f.done
	}
	return "", ctx.Err()
}

// parkExpired stops a download nobody came back for within the unattended
// timeout (gen names the spell the timer was set for).
func (c *Cache) parkExpired(sha string, f *flight, gen int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if f.parkGen != gen || len(f.waiters) > 0 || f.stopping {
		return
	}
	c.log.Info("imagecache: nobody came back for the download; stopping it, keeping what it fetched", "sha256", sha)
	f.stopping = true
	f.cancel(errUnattended)
}

// Close stops every download in progress, keeping what each fetched so a
// Cache over the same directory resumes it, and waits for them to stop.
// Ensure fails with ErrClosed from then on.
func (c *Cache) Close() {
	c.mu.Lock()
	c.closed = true
	var fs []*flight
	for _, f := range c.flights {
		if !f.stopping {
			f.stopping = true
			f.cancel(ErrClosed)
		}
		fs = append(fs, f)
	}
	c.mu.Unlock()
	for _, f := range fs {
		<-f.done
	}
}
