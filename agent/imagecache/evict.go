package imagecache

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Acquire pins an image so that eviction leaves it alone. Pins count: each
// Acquire needs one Release. Pinning a digest that is not cached yet is
// allowed and is the intended order (Acquire, then Ensure).
func (c *Cache) Acquire(sha256 string) {
	c.mu.Lock()
	if c.pins[sha256]++; c.pins[sha256] == 1 {
		c.noteChangeLocked()
	}
	c.mu.Unlock()
}

// Release drops one pin taken by Acquire.
func (c *Cache) Release(sha256 string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pins[sha256] <= 1 {
		delete(c.pins, sha256)
		c.noteChangeLocked()
		return
	}
	c.pins[sha256]--
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
		if c.removeLocked(e, "evicted") {
			total -= e.size
		}
	}
	if total > c.maxBytes {
		c.log.Warn("imagecache: over cap, the rest is in use", "bytes", total, "cap", c.maxBytes)
	}
}

// removeLocked deletes a finished image and what the cache knows of it,
// and says whether it went; c.mu is held. why is the log's word for it.
func (c *Cache) removeLocked(e entry, why string) bool {
	if err := os.Remove(e.path); err != nil {
		c.log.Warn("imagecache: remove", "why", why, "path", e.path, "err", err)
		return false
	}
	os.Remove(c.verifiedPath(e.sha))
	delete(c.verified, e.sha)
	c.noteChangeLocked()
	c.log.Info("imagecache: "+why, "sha256", e.sha, "bytes", e.size)
	return true
}

// allocated is the disk space a file takes, which for a sparse raw image is
// far less than its length.
func allocated(fi os.FileInfo) int64 {
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return st.Blocks * 512
	}
	return fi.Size()
}
