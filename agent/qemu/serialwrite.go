package qemu

import (
	"context"
	"time"
)

// writeLock is a VM's input connection's lock: a mutex whose wait ends
// with the waiter's context, so input piled up behind a guest that does
// not read its console gives up when its caller does.
type writeLock chan struct{}

// LockContext takes the lock, or fails once ctx ends.
func (l writeLock) LockContext(ctx context.Context) error {
	select {
	case l <- struct{}{}:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Lock takes the lock, however long that takes (the idle timer and a
// VM's end: each waits at most one write).
func (l writeLock) Lock() { l <- struct{}{} }

func (l writeLock) Unlock() { <-l }

// write writes data to the open connection within serialWriteTimeout, and
// ends sooner if ctx does (with ctx's error). The caller holds c.mu.
func (c *serialConn) write(ctx context.Context, data []byte) error {
	conn := c.conn
	deadline := time.Now().Add(serialWriteTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	_ = conn.SetWriteDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = conn.SetWriteDeadline(time.Now()) })
	defer stop()
	_, err := conn.Write(data)
	if err != nil {
		// Cut short by the caller: say so, not "the guest is not reading".
		if cerr := ctx.Err(); cerr != nil {
			return cerr
		}
		if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
			return context.DeadlineExceeded
		}
	}
	return err
}
