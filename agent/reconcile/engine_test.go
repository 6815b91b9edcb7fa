package reconcile

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestNewRequiresItsBuildingBlocks(t *testing.T) {
	_, err := New(Config{})
	require.Error(t, err)
}

func TestApplyCreatesAndReportsReady(t *testing.T) {
	f := setup(t)
	rep := f.apply(snap(7, vm("vm1"), vm("vm2")))

	assert.Equal(t, uint64(7), rep.GetAppliedGeneration())
	require.Len(t, rep.GetVms(), 2)
	assert.Equal(t, "vm1", rep.GetVms()[0].GetVmId(), "rows are sorted by id")
	for _, r := range rep.GetVms() {
		rec := f.record(r.GetVmId())
		assert.Equal(t, "ready", r.GetPhase())
		assert.Equal(t, "running", r.GetPower())
		assert.Empty(t, r.GetStatusDetail())
		assert.Empty(t, r.GetLastError())
		assert.Equal(t, rec.IP, r.GetIp(), "the address is persisted")
		assert.NotEmpty(t, r.GetIp())
		assert.Equal(t, rec.HostPubKey, r.GetSshHostPubkey())
	}
	p := f.seeds.last()
	assert.Equal(t, "ssh-ed25519 AAAA user@test", p.SSHAuthorizedKey)
	assert.True(t, strings.HasPrefix(p.Hostname, "name-vm"))
	assert.Empty(t, rep.GetDestroyed())
	assert.Empty(t, rep.GetQuarantined())
}

func TestStaleSnapshotIsIgnored(t *testing.T) {
	f := setup(t)
	f.apply(snap(5, vm("vm1")))
	assert.False(t, f.eng.Apply(snap(4)), "older than the newest applied")
	f.waitIdle()
	rep := f.eng.Report()
	assert.Equal(t, uint64(5), rep.GetAppliedGeneration())
	assert.Empty(t, rep.GetQuarantined(), "the stale snapshot's absence of vm1 was not acted on")
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase())

	assert.True(t, f.eng.Apply(snap(5, vm("vm1"))), "the newest generation may be resent")
	assert.False(t, f.eng.Apply(nil))
}

func TestChangedSignalsNewState(t *testing.T) {
	f := setup(t)
	// Drain anything pending.
	select {
	case <-f.eng.Changed():
	default:
	}
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	require.Eventually(t, func() bool {
		select {
		case <-f.eng.Changed():
			return f.row("vm1").GetPhase() == "ready"
		default:
			return false
		}
	}, 5*time.Second, time.Millisecond, "every change (including the last) is signalled")
}

// A VM inside a slow step must not hold up the report, and its row says
// which step it is in.
func TestBusyVMDoesNotBlockTheReport(t *testing.T) {
	f := setup(t)
	arrived := make(chan struct{}, 1)
	release := make(chan struct{})
	f.eng.cfg.Images = unpinned(func(ctx context.Context, _, sha string, _ func(int64, int64)) (string, error) {
		if sha == "wedge" {
			arrived <- struct{}{}
			<-release
		}
		return "/cache/" + sha + ".raw", nil
	})
	slow := vm("vm1")
	slow.ImageSha256 = "wedge"
	require.True(t, f.eng.Apply(snap(1, slow, vm("vm2"))))
	<-arrived

	f.eventuallyRow("vm2", phaseIs("ready"), "the other VM settles while vm1 is wedged")
	row := f.row("vm1") // returns while vm1's pass is still inside the fetch
	require.NotNil(t, row, "a wedged create is still in the report")
	assert.Equal(t, "creating", row.GetPhase())
	assert.Equal(t, "downloading image", row.GetStatusDetail())
	assert.NotEmpty(t, row.GetSshHostPubkey())

	close(release)
	f.waitIdle()
	assert.Equal(t, "ready", f.row("vm1").GetPhase())
}

func TestCreateConcurrencyIsCapped(t *testing.T) {
	f := setup(t, func(c *Config) { c.MaxConcurrentCreates = 2 })
	var inFetch atomic.Int32
	entered := make(chan struct{}, 3)
	release := make(chan struct{})
	f.eng.cfg.Images = unpinned(func(ctx context.Context, _, sha string, _ func(int64, int64)) (string, error) {
		inFetch.Add(1)
		defer inFetch.Add(-1)
		entered <- struct{}{}
		<-release
		return "/cache/" + sha + ".raw", nil
	})
	require.True(t, f.eng.Apply(snap(1, vm("vm1"), vm("vm2"), vm("vm3"))))
	<-entered
	<-entered

	// The third is queued for a slot and says so.
	var queued string
	require.Eventually(t, func() bool {
		for _, r := range f.eng.Report().GetVms() {
			if r.GetStatusDetail() == "waiting for a create slot on this host" {
				queued = r.GetVmId()
				return true
			}
		}
		return false
	}, 5*time.Second, time.Millisecond)
	assert.Equal(t, int32(2), inFetch.Load(), "only two creates are past the slot")
	assert.Len(t, f.eng.slots, 2, "both slots are held")
	assert.Equal(t, 3, f.hv.count("preflight"), "preflight runs before the slot wait")

	close(release)
	f.waitIdle()
	for _, id := range []string{"vm1", "vm2", "vm3"} {
		assert.Equal(t, "ready", f.row(id).GetPhase(), id)
	}
	assert.NotEmpty(t, queued)
	assert.Empty(t, f.eng.slots, "every slot was released")
}

func TestVMTimeoutBoundsSlowOperations(t *testing.T) {
	f := setup(t, func(c *Config) { c.VMTimeout = 50 * time.Millisecond })
	f.eng.cfg.Images = unpinned(func(ctx context.Context, _, _ string, _ func(int64, int64)) (string, error) {
		<-ctx.Done() // wedged until the watchdog fires
		return "", ctx.Err()
	})
	row := f.apply(snap(1, vm("vm1")))
	r := findVM(row, "vm1")
	require.NotNil(t, r)
	assert.Equal(t, "creating", r.GetPhase(), "a timed-out create is retried, not failed")
	assert.Contains(t, r.GetLastError(), "deadline exceeded")
	rec := f.record("vm1")
	assert.Equal(t, 0, rec.CreateAttempts)
	assert.False(t, rec.Failed)
	assert.Contains(t, rec.LastError, "deadline exceeded")
}

func TestVMTimeoutZeroDisablesTheWatchdog(t *testing.T) {
	f := setup(t) // VMTimeout 0
	var sawDeadline atomic.Bool
	f.eng.cfg.Images = unpinned(func(ctx context.Context, _, _ string, _ func(int64, int64)) (string, error) {
		_, ok := ctx.Deadline()
		sawDeadline.Store(ok)
		return "/cache/x.raw", nil
	})
	rep := f.apply(snap(1, vm("vm1")))
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase())
	assert.False(t, sawDeadline.Load())
}

func TestWatchdogExpiryRefundsCreateAttempts(t *testing.T) {
	f := setup(t, func(c *Config) {
		c.VMTimeout = 20 * time.Millisecond
		c.ResyncInterval = 5 * time.Millisecond
		c.MaxCreateAttempts = 2
	})
	var fetches atomic.Int32
	f.eng.cfg.Images = unpinned(func(ctx context.Context, _, _ string, _ func(int64, int64)) (string, error) {
		fetches.Add(1)
		<-ctx.Done()
		return "", ctx.Err()
	})
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	require.Eventually(t, func() bool { return fetches.Load() >= 4 }, 5*time.Second, time.Millisecond,
		"more timed-out attempts than the budget allows")
	rec := f.record("vm1")
	assert.Equal(t, 0, rec.CreateAttempts, "waiting is not the VM's fault")
	assert.False(t, rec.Failed)
	assert.NotEqual(t, "failed", f.row("vm1").GetPhase())
}

func TestCreateFailures(t *testing.T) {
	for _, c := range []struct {
		name     string
		err      error
		attempts int // fetches before it is terminal
	}{
		{"permanent error fails in one attempt", permErr{"unsupported image format"}, 1},
		{"wrapped permanent error too", errors.Join(errors.New("fetch"), permErr{"bad digest"}), 1},
		{"transient error spends the whole budget", errors.New("connection reset"), 5},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := setup(t, func(cfg *Config) { cfg.ResyncInterval = 5 * time.Millisecond })
			var fetches atomic.Int32
			f.eng.cfg.Images = unpinned(func(context.Context, string, string, func(int64, int64)) (string, error) {
				fetches.Add(1)
				return "", c.err
			})
			require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
			r := f.eventuallyRow("vm1", phaseIs("failed"), "the create fails terminally")
			assert.Equal(t, c.err.Error(), r.GetLastError())
			assert.Empty(t, r.GetStatusDetail(), "failed is settled")
			assert.NotEmpty(t, r.GetSshHostPubkey())
			rec := f.record("vm1")
			assert.True(t, rec.Failed)
			assert.Equal(t, c.attempts, rec.CreateAttempts)

			// Failed is terminal: further passes (resync, new snapshots) fetch nothing.
			f.apply(snap(2, vm("vm1")))
			f.waitPasses("vm1", 3) // several periodic re-checks
			assert.Equal(t, int32(c.attempts), fetches.Load())
			assert.Equal(t, "failed", f.row("vm1").GetPhase())
		})
	}
}

func TestTransientFailureSaysItWillRetry(t *testing.T) {
	f := setup(t)
	f.eng.cfg.Images = unpinned(func(context.Context, string, string, func(int64, int64)) (string, error) {
		return "", errors.New("connection reset")
	})
	r := findVM(f.apply(snap(1, vm("vm1"))), "vm1")
	assert.Equal(t, "creating", r.GetPhase())
	assert.Equal(t, "connection reset", r.GetLastError())
	assert.Equal(t, "attempt 1 of 5 failed: connection reset; retrying now", r.GetStatusDetail())
}

// hostFaultErr is a failure the host owns and has dealt with (KVM broke and
// the host moved to another accelerator).
type hostFaultErr struct{ msg string }

func (e hostFaultErr) Error() string   { return e.msg }
func (e hostFaultErr) HostFault() bool { return true }

func TestHostFaultIsRetriedWithoutSpendingAnAttempt(t *testing.T) {
	f := setup(t, func(c *Config) {
		c.MaxCreateAttempts = 1
		c.ResyncInterval = 5 * time.Millisecond
	})
	fault := fmt.Errorf("hostvm: vm vm1: %w", hostFaultErr{"kvm with -cpu host failed; this host now runs guests under tcg"})
	f.hv.set(func(h *fakeHyper) { h.bootErr = fault })

	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	r := f.eventuallyRow("vm1", detailIs("host fault, will retry"), "the attempt is refunded")
	assert.Equal(t, "creating", r.GetPhase())
	assert.Equal(t, fault.Error(), r.GetLastError())
	require.Eventually(t, func() bool { return f.hv.count("boot") >= 3 }, 5*time.Second, time.Millisecond,
		"more boots than the budget of one allows")
	rec := f.record("vm1")
	assert.Equal(t, 0, rec.CreateAttempts)
	assert.False(t, rec.Failed)

	f.hv.set(func(h *fakeHyper) { h.bootErr = nil })
	f.eventuallyRow("vm1", phaseIs("ready"), "the next attempt boots it")
}

func TestPreflightRefusalHappensBeforeTheImageFetch(t *testing.T) {
	f := setup(t)
	f.hv.set(func(h *fakeHyper) { h.preflightErr = permErr{"needs 64 GiB of memory; host has 8"} })
	var fetches atomic.Int32
	f.eng.cfg.Images = unpinned(func(context.Context, string, string, func(int64, int64)) (string, error) {
		fetches.Add(1)
		return "/cache/x.raw", nil
	})
	var said []string
	out := f.eng.create(context.Background(), vm("vm1"), state.Record{}, false,
		func(r *eitriv1.ActualVM) { said = append(said, r.GetStatusDetail()) })

	assert.Equal(t, int32(0), fetches.Load())
	assert.Empty(t, said, "a refused create never queues for a slot")
	assert.Equal(t, "failed", out.row.GetPhase())
	assert.Equal(t, "needs 64 GiB of memory; host has 8", out.row.GetLastError())
	assert.Equal(t, 1, f.record("vm1").CreateAttempts)
	assert.Equal(t, 0, f.hv.count("prepare"))
}

func TestConvergeDrivesPower(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, vm("vm1")))
	ip := f.row("vm1").GetIp()

	rep := f.apply(snap(2, stopped(vm("vm1"))))
	r := findVM(rep, "vm1")
	assert.Equal(t, "stopped", r.GetPhase())
	assert.Equal(t, "stopped", r.GetPower())
	assert.Equal(t, ip, r.GetIp(), "the last known address stands")
	assert.False(t, f.hv.isRunning("vm1"))
	assert.Equal(t, 1, f.hv.count("shutdown"))

	rep = f.apply(snap(3, vm("vm1")))
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase())
	assert.Equal(t, 2, f.hv.count("boot"))
	assert.Equal(t, 1, f.hv.count("prepare"), "an existing VM is never rebuilt")
}

func TestRunningVMWithoutAddressWaitsForOne(t *testing.T) {
	f := setup(t, func(c *Config) { c.ResyncInterval = 5 * time.Millisecond })
	f.hv.set(func(h *fakeHyper) { h.noAddress = true })
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	r := f.eventuallyRow("vm1", phaseIs("creating"), "booted but unleased")
	r = f.eventuallyRow("vm1", detailIs("waiting for an address"), "booted but unleased")
	assert.Equal(t, "running", r.GetPower())
	assert.Empty(t, r.GetIp())

	// The periodic re-check notices the lease without a new snapshot.
	f.hv.set(func(h *fakeHyper) { h.noAddress = false })
	r = f.eventuallyRow("vm1", phaseIs("ready"), "the lease is noticed")
	assert.Empty(t, r.GetStatusDetail())
	assert.Equal(t, "10.0.0.10", r.GetIp())
	assert.Equal(t, "10.0.0.10", f.record("vm1").IP)
}

// A power reading that fails invents nothing: the last known power and phase
// stand, with the error.
func TestPowerReadFailureKeepsTheLastKnownRow(t *testing.T) {
	f := setup(t, func(c *Config) { c.ResyncInterval = 5 * time.Millisecond })
	f.apply(snap(1, vm("vm1")))
	f.hv.set(func(h *fakeHyper) { h.powerErr = errors.New("qmp: connection refused") })
	r := f.eventuallyRow("vm1", func(r *eitriv1.ActualVM) bool { return r.GetLastError() != "" }, "the error is reported")
	assert.Equal(t, "qmp: connection refused", r.GetLastError())
	assert.Equal(t, "ready", r.GetPhase())
	assert.Equal(t, "running", r.GetPower())
	assert.NotEmpty(t, r.GetSshHostPubkey())
	assert.Equal(t, 1, f.hv.count("boot"), "an unknown power state is not acted on")

	f.hv.set(func(h *fakeHyper) { h.powerErr = nil })
	f.eventuallyRow("vm1", func(r *eitriv1.ActualVM) bool { return r.GetLastError() == "" }, "recovers")
}

func TestResyncRebootsACrashedGuest(t *testing.T) {
	f := setup(t, func(c *Config) { c.ResyncInterval = 5 * time.Millisecond })
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	f.eventuallyRow("vm1", phaseIs("ready"), "created")
	f.hv.crash("vm1")
	require.Eventually(t, func() bool { return f.hv.count("boot") >= 2 }, 5*time.Second, time.Millisecond,
		"the guest is booted again without a new snapshot")
	f.eventuallyRow("vm1", phaseIs("ready"), "back up")
}

// A soft-deleted VM keeps its disk until the control plane says destroy;
// this host's clock passing destroy_at decides nothing (it may run ahead of
// the clock the console's "restorable until" was read from).
func TestASoftDeletedVMIsDestroyedOnlyWhenTheControlPlaneSaysSo(t *testing.T) {
	f := setup(t, func(c *Config) { c.ResyncInterval = 5 * time.Millisecond })
	f.apply(snap(1, vm("vm1")))
	key := f.row("vm1").GetSshHostPubkey()

	del := vm("vm1")
	del.Deleted = true
	del.DestroyAtUnix = f.clock.Now().Add(time.Hour).Unix()
	r := findVM(f.apply(snap(2, del)), "vm1")
	require.NotNil(t, r)
	assert.Equal(t, "deleting", r.GetPhase())
	assert.Equal(t, "stopped", r.GetPower())
	assert.Equal(t, key, r.GetSshHostPubkey(), "the VM still exists, so its key is still reported")
	assert.Empty(t, r.GetStatusDetail())
	assert.True(t, f.hv.hasDisk("vm1"), "the disk is kept for a restore")
	assert.False(t, f.hv.isRunning("vm1"))

	f.clock.Advance(2 * time.Hour)
	f.waitPasses("vm1", 3)
	assert.Equal(t, 0, f.hv.count("destroy"), "this host's clock passing destroy_at destroys nothing")
	assert.True(t, f.hv.hasDisk("vm1"))

	order := vm("vm1")
	order.Deleted, order.Destroy = true, true
	rep := f.apply(snap(3, order))
	assert.Equal(t, []string{"vm1"}, rep.GetDestroyed())
	assert.Nil(t, findVM(rep, "vm1"), "a destroyed VM has no row")
	assert.False(t, f.hv.hasDisk("vm1"))
	_, ok, err := f.st.LoadVM("vm1")
	require.NoError(t, err)
	assert.False(t, ok)

	// Level-triggered: still reported while a snapshot names it, and never recreated.
	rep = f.apply(snap(4, order))
	assert.Equal(t, []string{"vm1"}, rep.GetDestroyed())
	assert.Equal(t, 1, f.hv.count("prepare"))
	rep = f.apply(snap(5))
	assert.Empty(t, rep.GetDestroyed(), "forgotten once no snapshot names it")
}

func TestRestoreBeforeDestroyAtBootsTheSameVM(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, vm("vm1")))
	del := vm("vm1")
	del.Deleted = true
	del.DestroyAtUnix = f.clock.Now().Add(time.Hour).Unix()
	f.apply(snap(2, del))
	require.False(t, f.hv.isRunning("vm1"))

	rep := f.apply(snap(3, vm("vm1")))
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase())
	assert.Equal(t, 1, f.hv.count("prepare"), "restored, not recreated")
}

func TestDeletedVMWithoutRecordIsReportedDestroyed(t *testing.T) {
	f := setup(t)
	del := vm("ghost")
	del.Deleted = true
	del.DestroyAtUnix = f.clock.Now().Add(time.Hour).Unix()
	rep := f.apply(snap(1, del))
	assert.Equal(t, []string{"ghost"}, rep.GetDestroyed())
	assert.Equal(t, 0, f.hv.count("prepare"), "a deleted VM is never created")
}

// A VM the desired state stops naming without a delete is held as it was
// (running), reported with its record, and taken back when named again.
func TestAnUnnamedVMIsHeldRunningThenAdopted(t *testing.T) {
	f := setup(t)
	d := vm("vm1")
	d.Owner, d.Version = "u-1", 40
	f.apply(snap(41, d))
	noticed := f.clock.Now()

	rep := f.apply(snap(42))
	assert.Nil(t, findVM(rep, "vm1"), "a held VM is not a desired VM's row")
	q := findQuarantined(rep, "vm1")
	require.NotNil(t, q)
	assert.Equal(t, "name-vm1", q.GetName())
	assert.Zero(t, q.GetDestroyAtUnix(), "never destroyed on this host's own")
	assert.False(t, q.GetStale())
	assert.Equal(t, noticed.Unix(), q.GetSinceUnix())
	assert.Contains(t, q.GetReason(), "no snapshot names it")
	assert.Equal(t, "running", q.GetPower())
	held := q.GetHeld()
	require.NotNil(t, held)
	assert.Equal(t, "http://images.test/base.raw", held.GetImageUrl())
	assert.Equal(t, "u-1", held.GetOwner(), "the owner comes from the agent's own record")
	assert.Equal(t, "running", held.GetPowerState())
	assert.Equal(t, uint64(40), held.GetVersion())
	var spec state.VMSpec
	require.NoError(t, json.Unmarshal(q.GetVmspecJson(), &spec))
	assert.Equal(t, "u-1", spec.Owner)
	assert.True(t, f.hv.isRunning("vm1"), "kept running")
	assert.Equal(t, 0, f.hv.count("shutdown"))
	assert.True(t, f.hv.hasDisk("vm1"))

	f.clock.Advance(time.Hour)
	rep = f.apply(snap(43))
	assert.Equal(t, noticed.Unix(), findQuarantined(rep, "vm1").GetSinceUnix(), "held since it was first noticed")

	adopted := vm("vm1")
	adopted.Owner, adopted.Version = "u-1", 44
	rep = f.apply(snap(45, adopted))
	assert.Empty(t, rep.GetQuarantined())
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase())
	assert.Equal(t, 1, f.hv.count("prepare"), "adopted, not recreated")
	assert.True(t, f.record("vm1").QuarantinedAt.IsZero())
	assert.Equal(t, uint64(44), f.record("vm1").Version)
}

// However long the desired state leaves it out, this host never destroys a
// VM on its own: only an admin's destroy (a newer version that says so)
// does.
func TestAnUnnamedVMIsNeverDestroyedByTheAgentsOwnClock(t *testing.T) {
	f := setup(t, func(c *Config) { c.ResyncInterval = 5 * time.Millisecond })
	f.apply(snap(1, vm("vm1")))
	f.apply(snap(2))
	require.NotNil(t, findQuarantined(f.eng.Report(), "vm1"))

	f.clock.Advance(30 * 24 * time.Hour)
	f.waitPasses("vm1", 3)
	rep := f.eng.Report()
	assert.NotNil(t, findQuarantined(rep, "vm1"))
	assert.Empty(t, rep.GetDestroyed())
	assert.Equal(t, 0, f.hv.count("destroy"))
	assert.True(t, f.hv.hasDisk("vm1"))
	assert.True(t, f.hv.isRunning("vm1"))

	// A crashed held guest is booted again: held running means running.
	f.hv.crash("vm1")
	require.Eventually(t, func() bool { return f.hv.isRunning("vm1") }, 5*time.Second, time.Millisecond)
}

// Local records from before a restart are adopted when named and quarantined
// when not; a running guest is never rebuilt.
func TestRestartAdoptsExistingVMs(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, vm("keep"), vm("orphan")))
	f.eng.Close()

	f2 := setupOn(t, f.st, f.hv)
	rep := f2.apply(snap(2, vm("keep")))
	assert.Equal(t, "ready", findVM(rep, "keep").GetPhase())
	assert.NotNil(t, findQuarantined(rep, "orphan"))
	assert.Equal(t, 2, f.hv.count("prepare"), "nothing was rebuilt")
	assert.Equal(t, 2, f.hv.count("boot"), "the running guest was not booted again")
}

// An unreadable record is never "no VM": the VM keeps its last row and is
// neither recreated nor quarantined.
func TestUnreadableRecordIsSkippedNotTreatedAsAbsent(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, vm("vm1")))
	before := f.row("vm1")
	corrupt := filepath.Join(f.st.Dir(), "vms", "vm1.json")
	require.FileExists(t, corrupt)
	require.NoError(t, os.WriteFile(corrupt, []byte("{not json"), 0o600))

	d := vm("vm1")
	d.PowerState = "stopped" // a change, so the worker runs a pass
	rep := f.apply(snap(2, d))
	assert.Equal(t, before, findVM(rep, "vm1"), "the last row stands")
	assert.Equal(t, 1, f.hv.count("prepare"))
	assert.True(t, f.hv.isRunning("vm1"), "nothing was done to the VM")

	rep = f.apply(snap(3))
	assert.Empty(t, rep.GetQuarantined())
	assert.Empty(t, rep.GetDestroyed())
	assert.Equal(t, 0, f.hv.count("destroy"))
}

func TestUnreadableRecordAtStartupIsLeftAlone(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, vm("vm1")))
	f.eng.Close()
	require.NoError(t, os.WriteFile(filepath.Join(f.st.Dir(), "vms", "vm1.json"), []byte("\x00"), 0o600))

	f2 := setupOn(t, f.st, f.hv)
	rep := f2.apply(snap(2))
	assert.Empty(t, rep.GetQuarantined())
	assert.Empty(t, rep.GetDestroyed())
	assert.Equal(t, 0, f.hv.count("destroy"))
	assert.True(t, f.hv.hasDisk("vm1"))
}

func TestInvalidVMIDIsIgnored(t *testing.T) {
	f := setup(t)
	rep := f.apply(snap(1, vm("../etc"), vm("ok")))
	assert.Nil(t, findVM(rep, "../etc"))
	assert.Equal(t, "ready", findVM(rep, "ok").GetPhase())
}

func TestCloseStopsWorkersAndRefusesSnapshots(t *testing.T) {
	f := setup(t)
	entered := make(chan struct{})
	f.eng.cfg.Images = unpinned(func(ctx context.Context, _, _ string, _ func(int64, int64)) (string, error) {
		close(entered)
		<-ctx.Done() // only Close ends this
		return "", ctx.Err()
	})
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	<-entered
	f.eng.Close() // returns: the wedged pass was cancelled and waited for
	assert.False(t, f.eng.Apply(snap(2, vm("vm1"))))
	rec := f.record("vm1")
	assert.Equal(t, 0, rec.CreateAttempts, "shutting down is not the VM's fault")
	assert.Empty(t, rec.LastError)
}

// BenchmarkApplyFillSteadyState: a host with 500 settled VMs receiving a
// snapshot that changes nothing, and building its report.
func BenchmarkApplyFillSteadyState(b *testing.B) {
	f := setup(b, func(c *Config) { c.MaxConcurrentCreates = 16 })
	vms := make([]*eitriv1.VMDesired, 500)
	for i := range vms {
		vms[i] = vm(fmt.Sprintf("vm-%03d", i))
	}
	f.hv.set(func(h *fakeHyper) { h.noAddress = false })
	f.apply(snap(1, vms...))
	require.Len(b, f.eng.Report().GetVms(), 500)

	rep := &eitriv1.ActualStateReport{}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		if !f.eng.Apply(snap(uint64(i+2), vms...)) {
			b.Fatal("snapshot refused")
		}
		f.eng.Fill(rep)
	}
	b.StopTimer()
	require.Len(b, rep.GetVms(), 500)
}
