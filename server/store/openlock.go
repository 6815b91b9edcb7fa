package store

import (
	"context"
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// lockOpening takes an exclusive flock on the SQLite file at path and
// returns its release. Stores that open one file at the same moment (two
// processes, or two Opens in one) would otherwise race to switch it to WAL
// and apply migrations, and SQLite answers one of them SQLITE_BUSY at once:
// a connection upgrading a shared lock is not queued behind the busy
// timeout, since that could deadlock. The flock queues them instead. Linux
// keeps flock and SQLite's fcntl locks apart, so this never blocks SQLite's
// own locking, and the lock is only held while opening.
func lockOpening(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("store: open %s: %w", path, err)
	}
	// LOCK_NB in a loop rather than a blocking flock, so a cancelled ctx
	// is honoured; the wait is only as long as another Open's migrations.
	const poll = 5 * time.Millisecond
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() { f.Close() }, nil // closing the file drops the lock
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("store: lock %s while opening: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("store: open %s: %w", path, ctx.Err())
		case <-time.After(poll):
		}
	}
}
