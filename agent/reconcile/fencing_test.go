package reconcile

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// from stamps a snapshot with the control plane lineage it comes from.
func from(cp string, epoch uint64, s *eitriv1.DesiredStateSnapshot) *eitriv1.DesiredStateSnapshot {
	s.ControlPlaneId, s.Epoch = cp, epoch
	return s
}

func versioned(d *eitriv1.VMDesired, v uint64) *eitriv1.VMDesired {
	d.Version = v
	return d
}

func TestASnapshotFromAnotherControlPlaneIsRefusedAndChangesNothing(t *testing.T) {
	f := setup(t)
	f.apply(from("cp-a", 1, snap(10, vm("vm1"))))
	before := f.row("vm1")

	assert.False(t, f.eng.Apply(from("cp-b", 1, snap(11))), "another control plane's word is not taken")
	f.waitIdle()
	rep := f.eng.Report()
	r := rep.GetSnapshotRefused()
	require.NotNil(t, r, "the refusal is reported, so the host shows it")
	assert.Equal(t, "cp-b", r.GetControlPlaneId())
	assert.Equal(t, uint64(11), r.GetGeneration())
	assert.Contains(t, r.GetReason(), "follows control plane cp-a")
	assert.Equal(t, before, findVM(rep, "vm1"))
	assert.Empty(t, rep.GetQuarantined(), "nothing is held on a refused snapshot's word")
	assert.True(t, f.hv.isRunning("vm1"))
	assert.Equal(t, "cp-a", rep.GetControlPlaneId())
	assert.Equal(t, uint64(10), rep.GetAppliedGeneration())

	assert.False(t, f.eng.Apply(from("", 0, snap(12))), "nor a snapshot that names no control plane")

	rep = f.apply(from("cp-a", 1, snap(13, vm("vm1"))))
	assert.Nil(t, rep.GetSnapshotRefused(), "cleared once a snapshot is applied")
}

// A control plane whose records went back in time (restored from an older
// copy, or lost its last commits) sends an older generation: refused, and
// still refused after the agent restarts.
func TestAGenerationGoingBackwardsIsRefusedAcrossAnAgentRestart(t *testing.T) {
	f := setup(t)
	f.apply(from("cp-a", 1, snap(100, vm("vm1"))))
	assert.False(t, f.eng.Apply(from("cp-a", 1, snap(50))))
	assert.Contains(t, f.eng.Report().GetSnapshotRefused().GetReason(), "older than the newest this host applied")
	f.eng.Close()

	f2 := setupOn(t, f.st, f.hv)
	cp, epoch, gen := f2.eng.Lineage()
	assert.Equal(t, "cp-a", cp, "Hello says what this host applied, so a control plane behind it learns it")
	assert.Equal(t, uint64(1), epoch)
	assert.Equal(t, uint64(100), gen)
	assert.False(t, f2.eng.Apply(from("cp-a", 1, snap(50))), "remembered durably")
	assert.False(t, f2.eng.Apply(from("cp-a", 0, snap(500))), "an earlier epoch is older whatever its generation")
	assert.Equal(t, 0, f.hv.count("shutdown"))
	assert.Equal(t, 0, f.hv.count("destroy"))

	// The control plane starts a new epoch past what this host applied.
	rep := f2.apply(from("cp-a", 2, snap(101, vm("vm1"))))
	assert.Nil(t, rep.GetSnapshotRefused())
	assert.Equal(t, uint64(2), rep.GetAppliedEpoch())
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase())
}

// The dangerous stale record: a control plane restored from before a
// restore still has the VM deleted, its destroy_at long past. The host
// applied the restore, so it neither stops nor destroys the VM; it holds it
// and says why, until an admin re-issues the row.
func TestAStaleRecordOfAVMIsHeldNotActedOn(t *testing.T) {
	f := setup(t)
	f.apply(from("cp-a", 1, snap(10, versioned(vm("vm1"), 9))))
	f.apply(from("cp-a", 1, snap(21, versioned(vm("vm1"), 20)))) // restored at version 20

	old := versioned(vm("vm1"), 15)
	old.Deleted, old.Destroy = true, true
	rep := f.apply(from("cp-a", 2, snap(30, old)))
	assert.Nil(t, rep.GetSnapshotRefused(), "a new epoch is applied, VM by VM")
	assert.True(t, f.hv.isRunning("vm1"), "not stopped on a stale word")
	assert.True(t, f.hv.hasDisk("vm1"), "not destroyed on a stale word")
	assert.Equal(t, 0, f.hv.count("shutdown"))
	assert.Empty(t, rep.GetDestroyed())
	r := findVM(rep, "vm1")
	require.NotNil(t, r, "named, so it keeps its row")
	assert.Equal(t, "ready", r.GetPhase())
	q := findQuarantined(rep, "vm1")
	require.NotNil(t, q)
	assert.True(t, q.GetStale())
	assert.Contains(t, q.GetReason(), "version 15")
	assert.Contains(t, q.GetReason(), "version 20")
	assert.Equal(t, "running", q.GetHeld().GetPowerState())
	assert.False(t, q.GetHeld().GetDeleted())
	assert.Equal(t, uint64(20), f.record("vm1").Version, "what was applied stays the mark")

	// The admin adopts it: a newer version, and the host takes the word again.
	rep = f.apply(from("cp-a", 2, snap(32, versioned(stopped(vm("vm1")), 31))))
	assert.Empty(t, rep.GetQuarantined())
	assert.Equal(t, "stopped", findVM(rep, "vm1").GetPhase())
}

// A restore that raced the destroy names a VM this host destroyed: it is
// answered with a failed row that says so, never with a fresh, empty disk,
// and that holds after an agent restart.
func TestADestroyedVMNamedAgainIsAFailedRowNeverAFreshDisk(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, vm("vm1")))
	gone := vm("vm1")
	gone.Deleted, gone.Destroy = true, true
	rep := f.apply(snap(2, gone))
	require.Equal(t, []string{"vm1"}, rep.GetDestroyed())

	check := func(f *fixture, rep *eitriv1.ActualStateReport) {
		t.Helper()
		r := findVM(rep, "vm1")
		require.NotNil(t, r)
		assert.Equal(t, "failed", r.GetPhase())
		assert.Contains(t, r.GetLastError(), "destroyed at 2026-12-02 12:00:00 UTC")
		assert.Empty(t, rep.GetDestroyed(), "named live, it is not reported as forgettable")
		assert.Equal(t, 1, f.hv.count("prepare"), "no fresh disk")
		assert.False(t, f.hv.hasDisk("vm1"))
	}
	check(f, f.apply(snap(3, vm("vm1"))))
	f.eng.Close()

	f2 := setupOn(t, f.st, f.hv)
	check(f2, f2.apply(snap(4, vm("vm1"))))
	rep = f2.apply(snap(5, gone))
	assert.Equal(t, []string{"vm1"}, rep.GetDestroyed(), "deleted again, it is forgettable again")
	assert.Nil(t, findVM(rep, "vm1"))
}

// A crash between marking a VM destroyed and removing it leaves a record:
// the next start finishes the destroy instead of adopting it.
func TestADestroyInterruptedByACrashIsFinishedAtStart(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, vm("vm1")))
	f.eng.Close()
	require.NoError(t, f.st.MarkDestroyed("vm1", time.Date(2026, 12, 2, 11, 0, 0, 0, time.UTC)))

	f2 := setupOn(t, f.st, f.hv)
	f2.apply(snap(2, vm("vm1")))
	f2.waitIdle()
	rep := f2.eng.Report()
	assert.False(t, f.hv.hasDisk("vm1"))
	_, ok, err := f.st.LoadVM("vm1")
	require.NoError(t, err)
	assert.False(t, ok)
	assert.Equal(t, "failed", findVM(rep, "vm1").GetPhase())
	assert.Equal(t, 1, f.hv.count("prepare"))
}
