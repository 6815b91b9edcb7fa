package qemu

import (
	"bytes"
	"context"
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// stuckGuest plays a QEMU whose guest never reads its console: it accepts
// the input connection and reads nothing, so the socket fills up. accepted
// says the agent has connected.
func stuckGuest(t *testing.T, b *Backend, id string) (accepted <-chan struct{}) {
	t.Helper()
	ln, err := net.Listen("unix", b.serialSockPath(id))
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	fakeQEMU(t, b, id, b.serialArgs(id)...)
	ch := make(chan struct{})
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		t.Cleanup(func() { c.Close() })
		close(ch)
	}()
	return ch
}

// A guest that never reads its serial input must not hold its callers:
// each write ends with its own caller's deadline instead of queueing
// behind every write before it (a tenant could pin call slots that way).
func TestInputWaitingBehindAStuckWriteEndsWithItsCallersDeadline(t *testing.T) {
	b, id := serialBackend(t)
	accepted := stuckGuest(t, b, id)
	t.Cleanup(func() { b.forgetSerial(id) })

	// A paste far larger than the socket holds: its write is stuck until
	// its own deadline.
	first := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		defer cancel()
		first <- b.SerialInput(ctx, id, bytes.Repeat([]byte("x"), 16<<20))
	}()
	<-accepted // the first call holds the connection's lock from its dial on

	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := b.SerialInput(ctx, id, []byte("y"))
	took := time.Since(start)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Contains(t, err.Error(), "still being written")
	assert.Less(t, took, 2*time.Second, "the wait ends with the caller's deadline, not the stuck write's")

	err = <-first
	require.Error(t, err)
	assert.ErrorIs(t, err, context.DeadlineExceeded, "the stuck write ends with its caller's deadline too")
}

func TestAStuckWriteEndsWhenItsCallerLeaves(t *testing.T) {
	b, id := serialBackend(t)
	accepted := stuckGuest(t, b, id)
	t.Cleanup(func() { b.forgetSerial(id) })

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- b.SerialInput(ctx, id, bytes.Repeat([]byte("x"), 16<<20)) }()
	<-accepted
	cancel()
	select {
	case err := <-done:
		assert.ErrorIs(t, err, context.Canceled)
	case <-time.After(serialWriteTimeout - time.Second):
		t.Fatal("the write went on after its caller left")
	}
}
