package hostvm

import (
	"net/netip"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/reconcile"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// TestAGuestWhoseQEMUIsKilledIsRestartedAndSaysSo: the defect was a QEMU
// that died and was booted again silently — "ready" through the whole
// reboot, no record, and the dead boot's console overwritten. Killing a
// real guest's QEMU must be narrated as a restart, reported with its signal
// and console, keep that console beside the new one, and after too many in
// a row fail the VM with the reason.
func TestAGuestWhoseQEMUIsKilledIsRestartedAndSaysSo(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		dir, url, sha := netnsEnv(t)
		const id, name = "vm-e2e-crash", "crash-1"
		killLeftovers(t, dir, id)
		h := startHost(t, dir, netip.MustParsePrefix("10.78.4.1/24"), true, func(_ *qemu.Config, e *reconcile.Config) {
			e.MaxRestarts = 1
			e.RetryBackoff = time.Second
		})
		t.Cleanup(func() { h.stop(t) })
		require.True(t, h.eng.Apply(snapshot(1, desiredVM(id, name, url, sha, "running"))))
		first := waitRow(t, h, id, readyWithin, "ready", isReady)
		readyLines := func() int { return strings.Count(h.qemu.SerialTail(id, 10000), "EITRI-GUEST-READY") }
		require.Eventually(t, readyLines1(readyLines), 30*time.Second, 100*time.Millisecond, "the guest printed its ready line")
		firstConsole := h.qemu.SerialTail(id, 5)

		kill := func() int {
			pid, ok := h.qemu.PID(id)
			require.True(t, ok)
			require.NoError(t, syscall.Kill(pid, syscall.SIGKILL))
			return pid
		}
		kill()
		restarting := waitRow(t, h, id, readyWithin, "restarting", func(r *eitriv1.ActualVM) bool {
			return r.GetPhase() == "restarting"
		})
		assert.Contains(t, []string{"qemu exited (signal 9); restarting, attempt 1", "waiting for an address"}, restarting.GetStatusDetail())
		assert.EqualValues(t, 1, restarting.GetUnexpectedExits())
		require.NotNil(t, restarting.GetLastExit())
		assert.Equal(t, "qemu exited (signal 9)", restarting.GetLastExit().GetReason())
		assert.Contains(t, restarting.GetLastExit().GetSerialTail(), "EITRI-GUEST-READY", "the exit carries the dead boot's console")

		again := waitRow(t, h, id, readyWithin, "ready again", isReady)
		assert.Equal(t, first.GetIp(), again.GetIp())
		assert.EqualValues(t, 1, again.GetUnexpectedExits())
		assert.Equal(t, firstConsole, h.qemu.PreviousSerialTail(id, 5), "the dead boot's console is kept as serial.log.1")
		kept, err := os.ReadFile(h.qemu.VMDir(id) + "/serial.log.1")
		require.NoError(t, err)
		assert.Equal(t, 1, strings.Count(string(kept), "EITRI-GUEST-READY"), "one boot per log")

		// Killed again before it stayed up: past MaxRestarts it fails, with
		// the reason, and is not booted again.
		kill()
		failed := waitRow(t, h, id, readyWithin, "failed", func(r *eitriv1.ActualVM) bool { return r.GetPhase() == "failed" })
		assert.Equal(t, "qemu exited (signal 9); gave up after 1 restart in a row", failed.GetLastError())
		assert.EqualValues(t, 2, failed.GetUnexpectedExits())
		time.Sleep(5 * 300 * time.Millisecond) // a few resyncs
		_, alive := h.qemu.PID(id)
		assert.False(t, alive, "a failed VM stays down")
		assert.Equal(t, "failed", rowOf(h.eng.Report(), id).GetPhase())

		// A retry gives it a fresh budget.
		d := desiredVM(id, name, url, sha, "running")
		d.Retry = 1
		require.True(t, h.eng.Apply(snapshot(2, d)))
		retried := waitRow(t, h, id, readyWithin, "ready after the retry", isReady)
		assert.Equal(t, uint64(1), retried.GetRetry())
	})
}

func readyLines1(n func() int) func() bool { return func() bool { return n() == 1 } }
