package store

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A retry is desired state (the host must hear of it); the count of exits
// already recorded is not.
func TestARetryIsADesiredChangeAndExitsSeenIsNot(t *testing.T) {
	eachEngine(t, testARetryIsADesiredChangeAndExitsSeenIsNot)
}

func testARetryIsADesiredChangeAndExitsSeenIsNot(t *testing.T, e engine) {
	ctx := context.Background()
	s, path := e.open(t)
	fixture(t, s)
	mustCreateVM(t, s, testVM("v1", "u1", "h1", "web", t0))
	created, err := s.GetVM(ctx, "v1")
	require.NoError(t, err)
	assert.Zero(t, created.Retry)
	assert.Zero(t, created.ExitsSeen)

	seen, changed, err := s.UpdateVM(ctx, "v1", func(v *VM) error { v.ExitsSeen = 3; return nil })
	require.NoError(t, err)
	assert.True(t, changed)
	assert.Equal(t, uint64(3), seen.ExitsSeen)
	assert.Equal(t, created.DesiredGen, seen.DesiredGen)

	retried, _, err := s.UpdateVM(ctx, "v1", func(v *VM) error { v.Retry++; return nil })
	require.NoError(t, err)
	assert.Equal(t, uint64(1), retried.Retry)
	assert.Greater(t, retried.DesiredGen, seen.DesiredGen)

	require.NoError(t, s.Close())
	s2, err := Open(ctx, path)
	require.NoError(t, err)
	defer s2.Close()
	again, err := s2.GetVM(ctx, "v1")
	require.NoError(t, err)
	assert.Equal(t, uint64(1), again.Retry)
	assert.Equal(t, uint64(3), again.ExitsSeen)
}
