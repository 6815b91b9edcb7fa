package imagecache

import (
	"log/slog"
	"time"
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
