// Package imagecache keeps base VM images on the host as raw disk files, one
// per sha256 digest. Ensure downloads an image over HTTP(S), verifies its
// digest while writing it, turns it into a raw image (qcow2 decoded natively,
// gzip decompressed, raw kept as is) and places it in the cache atomically
// and durably. It connects only to addresses its AddressPolicy allows (public
// ones by default), checked at every connect, and gives up on a download that
// stops making progress.
//
// A download belongs to the cache, not to the caller that started it: it
// goes on while any caller wants the image (see Ensure), and one that fails
// or is stopped keeps what it fetched, resumed later with an HTTP Range
// request. The served bytes are kept whole and decoded only once their digest
// matches: decoding never sees a byte that was not verified, and a resume
// needs nothing but the served bytes and the hash state over them.
//
// Layout of the cache directory:
//
//	<sha256>.raw              a finished raw image, named by the digest of
//	                          the bytes as served (not of the raw result)
//	<sha256>.verified         what the finished image was when placed (its
//	                          size); written before the image is renamed in
//	<sha256>.download.part    the served bytes fetched so far
//	<sha256>.download.resume  how to ask for the rest (validators, length,
//	                          the sha256 state over the synced bytes)
//	*.part                    any other: work in progress, swept on first use
//
// Finished images and their records are synced (file, then directory) before
// they are trusted. After a restart each image is checked against its record
// the first time it is used; one that does not match is fetched again.
//
// Only one Cache (one process) may own a directory at a time.
package imagecache

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/a73x/eitri/agent/permanent"
)

// DefaultProgressStep is how far a download moves between progress reports.
// Per-read callbacks would fire thousands of times per image; 32 MiB is often
// enough for a watcher to see the number climb and rare enough to cost nothing.
const DefaultProgressStep = 32 << 20

// DefaultProgressInterval is the longest a moving download goes unreported:
// on a slow link 32 MiB can take minutes, and a bar (and its rate) that sits
// still that long reads as a stall.
const DefaultProgressInterval = time.Second

// DefaultStallTimeout is the window in which a download must make progress
// (get its response, then DefaultMinProgress more bytes) or be abandoned.
// There is no cap on total time, so big images on slow links finish, but a
// hung or trickling connection cannot hold a worker for long.
const DefaultStallTimeout = 60 * time.Second

// DefaultUnattendedTimeout is how long a download goes on after every caller
// waiting for it ran out of time (their context's deadline passed): long
// enough for the caller's retry to come back and find it further along (a
// create pass that timed out is retried within seconds), short enough that
// one nobody comes back for (its VM was deleted between passes) wastes
// little. It then stops, keeping what it fetched, so a retry that was merely
// late (queued for a create slot) resumes it.
const DefaultUnattendedTimeout = 30 * time.Second

// partialMaxAge is how long a partial download nobody resumes is kept.
const partialMaxAge = 24 * time.Hour

// DefaultMinProgress is how many bytes a download must receive in each stall
// window: 1 MiB per 60 s, about 17 KiB/s, far below any link an image could
// be fetched over within a pass timeout, and far above a trickle.
const DefaultMinProgress = 1 << 20

// Option configures a Cache.
type Option func(*Cache)

// WithMaxBytes caps the disk space the finished images may take (allocated
// blocks, so sparse holes are free). 0, the default, means no cap. Work files
// of downloads in progress are not counted; a download larger than the cap is
// refused as soon as that is known.
func WithMaxBytes(n int64) Option { return func(c *Cache) { c.maxBytes = n } }

// WithProgressStep sets how many bytes pass between progress reports.
func WithProgressStep(n int64) Option {
	return func(c *Cache) {
		if n > 0 {
			c.progressStep = n
		}
	}
}

// WithProgressInterval sets the longest a download that moved goes without
// a progress report, whatever the step.
func WithProgressInterval(d time.Duration) Option {
	return func(c *Cache) {
		if d > 0 {
			c.progressEvery = d
		}
	}
}

// WithStallTimeout sets the window in which a download must make progress.
func WithStallTimeout(d time.Duration) Option {
	return func(c *Cache) {
		if d > 0 {
			c.stall = d
		}
	}
}

// WithMinProgress sets how many bytes a download must receive in each stall
// window; fewer ends it as stalled. 0 counts any byte as progress.
func WithMinProgress(n int64) Option {
	return func(c *Cache) {
		if n >= 0 {
			c.minProgress = n
		}
	}
}

// WithUnattendedTimeout sets how long a download goes on once every caller
// waiting for it has run out of time; 0 stops it at once, as when its callers
// are cancelled, but keeps what it fetched.
func WithUnattendedTimeout(d time.Duration) Option {
	return func(c *Cache) {
		if d >= 0 {
			c.unattended = d
		}
	}
}

// WithDialPolicy sets which addresses downloads may connect to. Without it
// only public addresses are allowed.
func WithDialPolicy(p AddressPolicy) Option { return func(c *Cache) { c.policy = p } }

// WithLogger sets the logger; the default is slog.Default().
func WithLogger(l *slog.Logger) Option { return func(c *Cache) { c.log = l } }

// Cache is a directory of raw images keyed by sha256. It is safe for
// concurrent use.
//
// Eviction and pinning: with a cap set, finishing a new image evicts the least
// recently used others (by file mtime, which Ensure refreshes on every hit)
// until the cache fits. An image is never evicted while pinned. A caller that
// keeps using an image after Ensure returns (a VM whose root disk is an
// overlay on it) must Acquire the digest BEFORE calling Ensure and Release it
// when done; pinning first leaves no window in which the image could go.
type Cache struct {
	dir           string
	maxBytes      int64
	progressStep  int64
	progressEvery time.Duration
	stall         time.Duration
	minProgress   int64
	unattended    time.Duration
	policy        AddressPolicy
	resolver      *net.Resolver // nil: the system's; tests set their own
	log           *slog.Logger

	sweepOnce sync.Once

	mu       sync.Mutex
	closed   bool
	flights  map[string]*flight // by sha256
	pins     map[string]int     // by sha256
	verified map[string]bool    // images checked against their record by this process
}

// New returns a cache over dir. The directory is created on first download.
func New(dir string, opts ...Option) *Cache {
	c := &Cache{
		dir:           dir,
		progressStep:  DefaultProgressStep,
		progressEvery: DefaultProgressInterval,
		stall:         DefaultStallTimeout,
		minProgress:   DefaultMinProgress,
		unattended:    DefaultUnattendedTimeout,
		log:           slog.Default(),
		flights:       map[string]*flight{},
		pins:          map[string]int{},
		verified:      map[string]bool{},
	}
	for _, o := range opts {
		o(c)
	}
	return c
}

// Dir returns the cache directory.
func (c *Cache) Dir() string { return c.dir }

// Path returns where the image with this digest lives once cached.
func (c *Cache) Path(sha256 string) string { return filepath.Join(c.dir, sha256+".raw") }

// Acquire pins an image so that eviction leaves it alone. Pins count: each
// Acquire needs one Release. Pinning a digest that is not cached yet is
// allowed and is the intended order (Acquire, then Ensure).
func (c *Cache) Acquire(sha256 string) {
	c.mu.Lock()
	c.pins[sha256]++
	c.mu.Unlock()
}

// Release drops one pin taken by Acquire.
func (c *Cache) Release(sha256 string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pins[sha256] <= 1 {
		delete(c.pins, sha256)
		return
	}
	c.pins[sha256]--
}

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

// populate makes sure the image is in the cache: a file already there that
// this process has not checked is checked first (a restart may follow a
// power loss); otherwise it is downloaded, verified, converted and placed.
// Every work file it makes is gone or kept for a resume when it returns.
func (c *Cache) populate(ctx context.Context, url, sha string, progress func(done, total int64)) (string, error) {
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return "", fmt.Errorf("image cache dir: %w", err)
	}
	c.sweepStale()
	final := c.Path(sha)
	if _, err := os.Stat(final); err == nil {
		why, err := c.checkCached(ctx, sha)
		if err != nil {
			return "", err
		}
		if why == "" {
			now := time.Now() // a hit: recency for eviction, as on any hit
			if err := os.Chtimes(final, now, now); err != nil {
				c.log.Warn("imagecache: touch", "path", final, "err", err)
			}
			c.markVerified(sha)
			return final, nil
		}
		c.log.Warn("imagecache: cached image cannot be trusted; fetching it again", "sha256", sha, "path", final, "why", why)
		if err := os.Remove(final); err != nil {
			return "", fmt.Errorf("image cache: %w", err)
		}
		os.Remove(c.verifiedPath(sha))
	}

	start := time.Now()
	dl, n, err := c.download(ctx, url, sha, progress)
	if err != nil {
		return "", err
	}
	decStart := time.Now()
	format, err := c.materialize(ctx, dl, sha)
	if err != nil {
		// The verified download is kept for another try at decoding,
		// unless decoding can never work or nobody wants it.
		if permanent.Is(err) || errors.Is(context.Cause(ctx), errUnwanted) {
			c.removePartial(sha)
		}
		return "", err
	}
	c.removePartial(sha) // a raw download was renamed; this takes its record
	c.markVerified(sha)
	c.log.Info("imagecache: image ready", "sha256", sha, "url", url, "format", format,
		"downloaded", n, "download", decStart.Sub(start).Round(time.Millisecond),
		"convert", time.Since(decStart).Round(time.Millisecond))
	c.evict(sha)
	return final, nil
}

func (c *Cache) markVerified(sha string) {
	c.mu.Lock()
	c.verified[sha] = true
	c.mu.Unlock()
}

// sweepPartials tidies the directory before this process first uses it:
// work files a process that died left behind go (their names are unique per
// attempt, so a leftover never collides with new work; this only returns the
// space), and so do records that lost their file. A partial download with
// its record is kept, to be resumed.
func (c *Cache) sweepPartials() {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return
	}
	have := map[string]bool{}
	for _, e := range ents {
		have[e.Name()] = true
	}
	for _, e := range ents {
		name := e.Name()
		var orphan bool
		switch {
		case strings.HasSuffix(name, ".download.part"):
			orphan = !validDigest(strings.TrimSuffix(name, ".download.part")) ||
				!have[strings.TrimSuffix(name, ".part")+".resume"]
		case strings.HasSuffix(name, ".part"):
			orphan = true
		case strings.HasSuffix(name, ".download.resume"):
			orphan = !have[strings.TrimSuffix(name, ".resume")+".part"]
		case strings.HasSuffix(name, ".verified"):
			orphan = !have[strings.TrimSuffix(name, ".verified")+".raw"]
		}
		if orphan {
			p := filepath.Join(c.dir, name)
			if err := os.Remove(p); err == nil {
				c.log.Info("imagecache: removed leftover work file", "path", p)
			}
		}
	}
}

// sweepStale removes partial downloads nobody has resumed for partialMaxAge
// (their VM went away while the download was stopped).
func (c *Cache) sweepStale() {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range ents {
		sha, ok := strings.CutSuffix(e.Name(), ".download.part")
		if !ok || !validDigest(sha) || c.flights[sha] != nil {
			continue
		}
		if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > partialMaxAge {
			c.removePartial(sha)
			c.log.Info("imagecache: removed a partial download nobody resumed", "sha256", sha, "bytes", fi.Size())
		}
	}
}

type entry struct {
	sha   string
	path  string
	size  int64 // allocated bytes
	mtime time.Time
}

// entries lists the finished images in the cache.
func (c *Cache) entries() ([]entry, error) {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, nil
		}
		return nil, err
	}
	var out []entry
	for _, e := range ents {
		sha, ok := strings.CutSuffix(e.Name(), ".raw")
		if !ok || !validDigest(sha) {
			continue
		}
		fi, err := e.Info()
		if err != nil {
			continue // removed under us
		}
		out = append(out, entry{sha: sha, path: filepath.Join(c.dir, e.Name()), size: allocated(fi), mtime: fi.ModTime()})
	}
	return out, nil
}

// Usage returns the bytes the finished images occupy on disk.
func (c *Cache) Usage() (int64, error) {
	es, err := c.entries()
	var total int64
	for _, e := range es {
		total += e.size
	}
	return total, err
}

// evict removes least recently used, unpinned images until the cache fits
// its cap. keep (the image just made) is never removed.
func (c *Cache) evict(keep string) {
	if c.maxBytes <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	es, err := c.entries()
	if err != nil {
		c.log.Warn("imagecache: list for eviction", "err", err)
		return
	}
	var total int64
	for _, e := range es {
		total += e.size
	}
	slices.SortFunc(es, func(a, b entry) int { return a.mtime.Compare(b.mtime) })
	for _, e := range es {
		if total <= c.maxBytes {
			return
		}
		if e.sha == keep || c.pins[e.sha] > 0 {
			continue
		}
		if err := os.Remove(e.path); err != nil {
			c.log.Warn("imagecache: evict", "path", e.path, "err", err)
			continue
		}
		os.Remove(c.verifiedPath(e.sha))
		delete(c.verified, e.sha)
		total -= e.size
		c.log.Info("imagecache: evicted", "sha256", e.sha, "bytes", e.size)
	}
	if total > c.maxBytes {
		c.log.Warn("imagecache: over cap, the rest is in use", "bytes", total, "cap", c.maxBytes)
	}
}

// allocated is the disk space a file takes, which for a sparse raw image is
// far less than its length.
func allocated(fi os.FileInfo) int64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Blocks * 512
	}
	return fi.Size()
}

func validDigest(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := range len(s) {
		ch := s[i]
		if (ch < '0' || ch > '9') && (ch < 'a' || ch > 'f') {
			return false
		}
	}
	return true
}
