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
	"sync"
	"time"

	"github.com/a73x/eitri/agent/permanent"
)

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
	changed  chan struct{}      // see Changed
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
		changed:       make(chan struct{}, 1),
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
			c.noteChangeLocked() // its last use moved
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
	c.noteChangeLocked()
	return final, nil
}

func (c *Cache) markVerified(sha string) {
	c.mu.Lock()
	c.verified[sha] = true
	c.mu.Unlock()
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
