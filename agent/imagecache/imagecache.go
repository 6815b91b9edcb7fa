// Package imagecache keeps base VM images on the host as raw disk files, one
// per sha256 digest. Ensure downloads an image over HTTP(S), verifies its
// digest while writing it, turns it into a raw image (qcow2 decoded natively,
// gzip decompressed, raw kept as is) and places it in the cache atomically.
// It connects only to addresses its AddressPolicy allows (public ones by
// default), checked at every connect, and gives up on a download that stops
// making progress.
//
// Layout of the cache directory:
//
//	<sha256>.raw          a finished raw image, named by the digest of the
//	                      bytes as served (not of the raw result)
//	<sha256>.*.part       work in progress; never read, swept on first use
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
)

// DefaultProgressStep is how far a download moves between progress reports.
// Per-read callbacks would fire thousands of times per image; 32 MiB is often
// enough for a watcher to see the number climb and rare enough to cost nothing.
const DefaultProgressStep = 32 << 20

// DefaultStallTimeout is the window in which a download must make progress
// (get its response, then DefaultMinProgress more bytes) or be abandoned.
// There is no cap on total time, so big images on slow links finish, but a
// hung or trickling connection cannot hold a worker for long.
const DefaultStallTimeout = 60 * time.Second

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
	dir          string
	maxBytes     int64
	progressStep int64
	stall        time.Duration
	minProgress  int64
	policy       AddressPolicy
	resolver     *net.Resolver // nil: the system's; tests set their own
	log          *slog.Logger

	sweepOnce sync.Once

	mu      sync.Mutex
	flights map[string]*flight // by sha256
	pins    map[string]int     // by sha256
}

// New returns a cache over dir. The directory is created on first download.
func New(dir string, opts ...Option) *Cache {
	c := &Cache{
		dir:          dir,
		progressStep: DefaultProgressStep,
		stall:        DefaultStallTimeout,
		minProgress:  DefaultMinProgress,
		log:          slog.Default(),
		flights:      map[string]*flight{},
		pins:         map[string]int{},
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

// flight is one download+decode of one image, shared by every Ensure caller
// for that digest that arrives while it runs.
type flight struct {
	done chan struct{}
	path string
	err  error

	cancel  context.CancelFunc
	waiters int // guarded by Cache.mu

	pmu      sync.Mutex
	progress func(done, total int64) // the leader's; nil once it has gone
}

// mute stops progress reports for good.
func (f *flight) mute() {
	f.pmu.Lock()
	f.progress = nil
	f.pmu.Unlock()
}

func (f *flight) report(done, total int64) {
	f.pmu.Lock()
	defer f.pmu.Unlock()
	if f.progress != nil {
		f.progress(done, total)
	}
}

// Ensure returns the path of the raw image whose served bytes have the given
// sha256 (64 lowercase hex digits), downloading and converting it from url if
// it is not cached yet.
//
// Concurrent calls for one digest share one download. The work runs on a
// context detached from every caller: a caller whose ctx ends stops waiting
// and gets ctx's error, and the download goes on for the others; it is
// cancelled only when every waiting caller has gone, and then leaves nothing
// behind: the last caller to leave returns once it has stopped.
//
// progress, if non-nil, is told how far the download has come, at most once
// per progress step, with total = the declared Content-Length or -1. Only the
// caller that started the download gets reports, and none after it returns;
// callers that joined a running download and cache hits get none. It is
// called from the copy loop, so it must not block.
//
// Errors that retrying cannot fix satisfy interface{ Permanent() bool }.
func (c *Cache) Ensure(ctx context.Context, url, sha256 string, progress func(done, total int64)) (string, error) {
	// Checked first: the digest becomes a file name, so a bad one must never
	// reach the disk, the network or the flight table.
	if !validDigest(sha256) {
		return "", permanentf("%w: %q: want 64 lowercase hex digits", ErrInvalidDigest, sha256)
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	c.sweepOnce.Do(c.sweepPartials)

	final := c.Path(sha256)
	c.mu.Lock()
	if f, ok := c.flights[sha256]; ok {
		f.waiters++
		c.mu.Unlock()
		return c.wait(ctx, sha256, f, false)
	}
	if _, err := os.Stat(final); err == nil {
		// Hit: refresh recency under the lock so eviction sees it.
		now := time.Now()
		if err := os.Chtimes(final, now, now); err != nil {
			c.log.Warn("imagecache: touch", "path", final, "err", err)
		}
		c.mu.Unlock()
		return final, nil
	}
	fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	f := &flight{done: make(chan struct{}), cancel: cancel, waiters: 1, progress: progress}
	c.flights[sha256] = f
	c.mu.Unlock()

	go func() {
		path, err := c.populate(fctx, url, sha256, f.report)
		cancel()
		c.mu.Lock()
		if c.flights[sha256] == f {
			delete(c.flights, sha256)
		}
		f.path, f.err = path, err
		c.mu.Unlock()
		close(f.done)
	}()
	return c.wait(ctx, sha256, f, true)
}

func (c *Cache) wait(ctx context.Context, sha string, f *flight, leader bool) (string, error) {
	if leader {
		// However the leader leaves, its callback must not fire afterwards:
		// it may publish into a pass that is no longer running.
		defer f.mute()
	}
	select {
	case <-f.done:
		return f.path, f.err
	case <-ctx.Done():
	}
	select {
	case <-f.done: // finished at the same moment: take the result
		return f.path, f.err
	default:
	}
	c.mu.Lock()
	f.waiters--
	last := f.waiters == 0
	if last {
		// Nobody wants it any more. Unlist it now so a later caller starts
		// afresh instead of joining a cancelled fetch; temp names are unique,
		// so the two never touch each other's files.
		if c.flights[sha] == f {
			delete(c.flights, sha)
		}
		f.cancel()
	}
	c.mu.Unlock()
	if last {
		// The last caller out waits for the work to wind down, so that when
		// it returns the download has stopped and its temp files are gone
		// (a cancelled create frees its slot with nothing of it left behind).
		// Every step of populate honours fctx, so this wait is short.
		f.mute()
		<-f.done
	}
	return "", ctx.Err()
}

// populate downloads, verifies and converts one image into the cache. Every
// temp file it makes is gone when it returns, on every path.
func (c *Cache) populate(ctx context.Context, url, sha string, progress func(done, total int64)) (string, error) {
	if err := os.MkdirAll(c.dir, 0o755); err != nil {
		return "", fmt.Errorf("image cache dir: %w", err)
	}
	start := time.Now()
	dl, n, err := c.download(ctx, url, sha, progress)
	if err != nil {
		return "", err
	}
	defer os.Remove(dl) // a no-op once renamed into place

	final := c.Path(sha)
	decStart := time.Now()
	format, err := c.materialize(ctx, dl, final, sha)
	if err != nil {
		return "", err
	}
	c.log.Info("imagecache: image ready", "sha256", sha, "url", url, "format", format,
		"downloaded", n, "download", decStart.Sub(start).Round(time.Millisecond),
		"convert", time.Since(decStart).Round(time.Millisecond))
	c.evict(sha)
	return final, nil
}

// sweepPartials removes work files left by a process that died mid-download.
// Their names are unique per attempt, so a leftover never collides with new
// work; this only returns the space.
func (c *Cache) sweepPartials() {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if strings.HasSuffix(e.Name(), ".part") {
			p := filepath.Join(c.dir, e.Name())
			if err := os.Remove(p); err == nil {
				c.log.Info("imagecache: removed leftover partial", "path", p)
			}
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
