package imagecache

import (
	"context"
	"os"
	"slices"
	"strings"
	"time"
)

// Image is one finished image in the cache, as Images and Prune tell it.
type Image struct {
	SHA256 string
	// Bytes is the disk space it takes (allocated blocks).
	Bytes int64
	// LastUsed is when a download or a hit last touched it.
	LastUsed time.Time
	// Pinned: held by Acquire right now (a pull, or a create in progress).
	Pinned bool
}

// Images lists the finished images, most recently used first.
func (c *Cache) Images() ([]Image, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	es, err := c.entries()
	if err != nil {
		return nil, err
	}
	out := make([]Image, 0, len(es))
	for _, e := range es {
		out = append(out, Image{SHA256: e.sha, Bytes: e.size, LastUsed: e.mtime, Pinned: c.pins[e.sha] > 0})
	}
	slices.SortFunc(out, func(a, b Image) int {
		if n := b.LastUsed.Compare(a.LastUsed); n != 0 {
			return n
		}
		return strings.Compare(a.SHA256, b.SHA256)
	})
	return out, nil
}

// Prune removes every finished image nothing wants: not pinned, not being
// downloaded again, and not kept by keep (the caller's word on what its
// VMs were made from). An image a VM's root disk is an overlay on must be
// kept that way: without a hard link beside the disk, the overlay reads the
// cache's file itself, and a pin taken for it lasts only while the process
// runs.
//
// It holds the cache's lock throughout, so no pin can be taken between the
// check and the removal; a caller that pins after it (Acquire, then
// Ensure) fetches the image again.
func (c *Cache) Prune(ctx context.Context, keep func(sha256 string) bool) ([]Image, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	es, err := c.entries()
	if err != nil {
		return nil, err
	}
	var removed []Image
	for _, e := range es {
		if err := ctx.Err(); err != nil {
			return removed, err
		}
		if c.pins[e.sha] > 0 || c.flights[e.sha] != nil || keep(e.sha) {
			continue
		}
		if c.removeLocked(e, "pruned") {
			removed = append(removed, Image{SHA256: e.sha, Bytes: e.size, LastUsed: e.mtime})
		}
	}
	return removed, nil
}

// Changed is signalled (coalesced) whenever what Images would say may have
// changed: an image placed, used, evicted or pruned, a pin taken or dropped.
func (c *Cache) Changed() <-chan struct{} { return c.changed }

// noteChangeLocked signals Changed. c.mu is held (or the caller needs no
// ordering with it).
func (c *Cache) noteChangeLocked() {
	select {
	case c.changed <- struct{}{}:
	default:
	}
}

// Holds says whether the image with this digest is in the cache now, so an
// Ensure for it would be a hit. It is a look, not a promise: the image may
// be evicted, or found torn, before the Ensure; that Ensure downloads it
// and reports its progress as any other.
func (c *Cache) Holds(sha256 string) bool {
	if !validDigest(sha256) {
		return false
	}
	// A download lands there only once whole and verified (place), and a
	// torn image is removed before it is fetched again.
	fi, err := os.Stat(c.Path(sha256))
	return err == nil && fi.Mode().IsRegular()
}
