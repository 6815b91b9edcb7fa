package qemu

import (
	"bytes"
	"context"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/qemu/qemutest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// zombieQEMUChildren lists this process's zombie QEMU children.
func zombieQEMUChildren(t *testing.T) []int {
	t.Helper()
	var out []int
	for pid, st := range qemuChildren() {
		if st.state == 'Z' {
			t.Logf("zombie %d: %+v", pid, st)
			out = append(out, pid)
		}
	}
	return out
}

func TestAQEMUKilledFromOutsideIsReportedOnceWithItsSignal(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b := newBackend(t, 300*time.Millisecond)
	vm := blankVM(t, b, "vm-killed")
	t.Cleanup(func() { _ = b.Destroy(context.Background(), vm.ID) })

	require.NoError(t, b.Start(ctx, vm))
	assert.Empty(t, zombieQEMUChildren(t), "-daemonize's middle process is reaped at start")
	_, exited := b.Exited(vm.ID)
	assert.False(t, exited, "a running QEMU has not exited")

	pid, ok := b.PID(vm.ID)
	require.True(t, ok)
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	require.Eventually(t, func() bool { _, ok := b.PID(vm.ID); return !ok }, 10*time.Second, 10*time.Millisecond)

	x, exited := b.Exited(vm.ID)
	require.True(t, exited)
	assert.Equal(t, "signal 9", x.Status)
	assert.Equal(t, "qemu exited (signal 9)", x.Reason())
	_, err := os.Stat("/proc/" + strconv.Itoa(pid))
	assert.ErrorIs(t, err, os.ErrNotExist, "the dead QEMU is reaped, not left a zombie")
	_, exited = b.Exited(vm.ID)
	assert.False(t, exited, "reported once")

	// Stopped on request is no exit; started again, it is watched again.
	require.NoError(t, b.Start(ctx, vm))
	require.NoError(t, b.Shutdown(ctx, vm.ID))
	_, exited = b.Exited(vm.ID)
	assert.False(t, exited, "a shutdown that was asked for is not an exit")
	assert.Empty(t, zombieQEMUChildren(t))
}

// An agent that restarts finds the pidfile of a QEMU that died while it was
// away: an exit whose status nobody here can read.
func TestAQEMUThatDiedWhileTheAgentWasAwayIsAnExitOfUnknownStatus(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b := newBackend(t, 300*time.Millisecond)
	vm := blankVM(t, b, "vm-away")
	t.Cleanup(func() { _ = b.Destroy(context.Background(), vm.ID) })
	require.NoError(t, b.Start(ctx, vm))
	pid, ok := b.PID(vm.ID)
	require.True(t, ok)

	restarted := newBackendAt(t, b.cfg.Dir, 300*time.Millisecond)
	require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
	require.Eventually(t, func() bool { _, ok := restarted.PID(vm.ID); return !ok }, 10*time.Second, 10*time.Millisecond)
	reap(pid) // the first backend's process would have; this test is both

	x, exited := restarted.Exited(vm.ID)
	require.True(t, exited)
	assert.Empty(t, x.Status)
	assert.Equal(t, "qemu exited (exit status unknown)", x.Reason())
	_, exited = restarted.Exited(vm.ID)
	assert.False(t, exited)
	_, exited = restarted.Exited("vm-never-started")
	assert.False(t, exited)
}

func TestTheLastBootsSerialLogIsKeptAndBounded(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b := newBackend(t, 300*time.Millisecond)
	vm := blankVM(t, b, "vm-serial")
	t.Cleanup(func() { _ = b.Destroy(context.Background(), vm.ID) })

	// The console of a boot that died, larger than what is kept.
	var old bytes.Buffer
	for i := 0; old.Len() < 3*serialKeepBytes; i++ {
		old.WriteString("boot line " + strconv.Itoa(i) + "\n")
	}
	old.WriteString("Kernel panic - not syncing: Attempted to kill init!\n")
	require.NoError(t, os.WriteFile(b.serialPath(vm.ID), old.Bytes(), 0o600))

	require.NoError(t, b.Start(ctx, vm))
	kept, err := os.ReadFile(b.serialPath(vm.ID) + ".1")
	require.NoError(t, err)
	assert.Len(t, kept, serialKeepBytes, "bounded")
	assert.True(t, bytes.HasSuffix(old.Bytes(), kept), "the end of the old log, as it was")
	assert.Equal(t, "Kernel panic - not syncing: Attempted to kill init!", b.PreviousSerialTail(vm.ID, 1))
	cur, err := os.ReadFile(b.serialPath(vm.ID))
	require.NoError(t, err)
	assert.NotContains(t, string(cur), "Kernel panic", "the new boot has a log of its own")

	// A boot that wrote nothing does not replace the kept log.
	require.NoError(t, b.Kill(ctx, vm.ID))
	require.NoError(t, b.Start(ctx, vm))
	assert.Equal(t, "Kernel panic - not syncing: Attempted to kill init!", b.PreviousSerialTail(vm.ID, 1))
}

// A QEMU that daemonizes and then fails to set up the machine (KVM's MSR
// abort on some hosts; here a device whose drive does not exist) dies as
// this process's child and was never watched: the failed start reaps it,
// and leaves no QEMU of it running.
func TestAStartThatFailsAfterDaemonizingLeavesNoZombie(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	bin, calls := qemutest.Wrap(t, `[ -n "$vm" ] && set -- "$@" -device virtio-blk-pci,drive=nosuchdrive`)
	b, err := New(Config{Dir: t.TempDir(), Log: hosttest.Logger(t), Binary: bin, Accel: AccelTCG})
	require.NoError(t, err)
	vm := blankVM(t, b, "vm-dies")
	t.Cleanup(func() { _ = b.Destroy(context.Background(), vm.ID) })

	err = b.Start(ctx, vm)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "nosuchdrive", "the start failed where the test made it fail")
	data, rerr := os.ReadFile(calls)
	require.NoError(t, rerr)
	require.Contains(t, string(data), "-daemonize", "precondition: the failing QEMU daemonized")
	assert.Empty(t, zombieQEMUChildren(t))
	_, ok := b.PID(vm.ID)
	assert.False(t, ok)
}
