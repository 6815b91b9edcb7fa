package store

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/wire/vmstate"
)

// Generations come from a stored counter, so a control plane whose clock
// stepped back across a restart still sends rising ones.
func TestGenerationsKeepRisingWhenTheClockStepsBackAcrossARestart(t *testing.T) {
	eachEngine(t, testGenerationsKeepRisingWhenTheClockStepsBackAcrossARestart)
}

func testGenerationsKeepRisingWhenTheClockStepsBackAcrossARestart(t *testing.T, e engine) {
	ctx := context.Background()
	s, path := e.open(t)
	first, err := s.Lineage(ctx)
	require.NoError(t, err)
	require.NotEmpty(t, first.ID)
	require.Equal(t, uint64(1), first.Epoch)
	a, err := s.NextGeneration(ctx)
	require.NoError(t, err)
	require.NoError(t, s.Close())

	s2, err := Open(ctx, path)
	require.NoError(t, err)
	defer s2.Close()
	s2.now = func() time.Time { return time.Now().Add(-time.Hour).UTC() }
	b, err := s2.NextGeneration(ctx)
	require.NoError(t, err)
	assert.Greater(t, b.Generation, a.Generation)
	assert.Equal(t, first.ID, b.ID, "the identity is made once")
	assert.Equal(t, first.Epoch, b.Epoch)
}

// A VM's desired version moves with what the agent is told, not with what
// the agent reports, and always past the last snapshot generation.
func TestOnlyADesiredChangeGivesTheVMANewVersion(t *testing.T) {
	eachEngine(t, testOnlyADesiredChangeGivesTheVMANewVersion)
}

func testOnlyADesiredChangeGivesTheVMANewVersion(t *testing.T, e engine) {
	ctx := context.Background()
	s, _ := e.open(t)
	fixture(t, s)
	mustCreateVM(t, s, testVM("v1", "u1", "h1", "web", t0))
	created, err := s.GetVM(ctx, "v1")
	require.NoError(t, err)

	reported, _, err := s.UpdateVM(ctx, "v1", func(v *VM) error { v.Status = "ready"; v.AssignedIP = "10.0.0.2"; return nil })
	require.NoError(t, err)
	assert.Equal(t, created.DesiredGen, reported.DesiredGen, "a reported status is not a desired change")

	snap, err := s.NextGeneration(ctx)
	require.NoError(t, err)
	stopped, _, err := s.UpdateVM(ctx, "v1", func(v *VM) error { v.PowerState = vmstate.PowerStopped; v.DesiredGen = 1; return nil })
	require.NoError(t, err)
	assert.Greater(t, stopped.DesiredGen, snap.Generation, "newer than every snapshot sent before it")

	same, err := s.ReassertVM(ctx, "v1", func(*VM) error { return nil })
	require.NoError(t, err)
	assert.Greater(t, same.DesiredGen, stopped.DesiredGen, "reasserting re-issues the row")
}

// A control plane restored from an older copy of its database learns from
// an agent that it lost writes: a new epoch, and a counter past what the
// agent applied.
func TestARestoredStoreFencesForwardPastWhatAnAgentApplied(t *testing.T) {
	eachEngine(t, testARestoredStoreFencesForwardPastWhatAnAgentApplied)
}

func testARestoredStoreFencesForwardPastWhatAnAgentApplied(t *testing.T, e engine) {
	ctx := context.Background()
	s, path := e.open(t)
	require.NoError(t, s.Close())
	backup := e.clone(t, path)

	s, err := Open(ctx, path)
	require.NoError(t, err)
	var applied Lineage
	for range 5 {
		applied, err = s.NextGeneration(ctx)
		require.NoError(t, err)
	}
	require.NoError(t, s.Close())

	old, err := Open(ctx, backup)
	require.NoError(t, err)
	defer old.Close()
	before, err := old.Lineage(ctx)
	require.NoError(t, err)
	assert.Equal(t, applied.ID, before.ID, "a backup carries the identity")
	require.Less(t, before.Generation, applied.Generation)

	l, bumped, err := old.FenceForward(ctx, applied.Epoch, applied.Generation)
	require.NoError(t, err)
	assert.True(t, bumped)
	assert.Equal(t, applied.Epoch+1, l.Epoch)
	next, err := old.NextGeneration(ctx)
	require.NoError(t, err)
	assert.Greater(t, next.Generation, applied.Generation)

	_, bumped, err = old.FenceForward(ctx, applied.Epoch, applied.Generation)
	require.NoError(t, err)
	assert.False(t, bumped, "an agent behind the store changes nothing")
	got, err := old.Lineage(ctx)
	require.NoError(t, err)
	assert.Equal(t, applied.Epoch+1, got.Epoch)
}
