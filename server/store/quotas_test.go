package store

import (
	"context"
	"errors"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestQuotaLimitsRoundTripAndNullMeansNotSet(t *testing.T) {
	eachEngine(t, testQuotaLimitsRoundTripAndNullMeansNotSet)
}

func testQuotaLimitsRoundTripAndNullMeansNotSet(t *testing.T, e engine) {
	s, path := e.open(t)
	fixture(t, s)
	ctx := context.Background()
	n := func(v int64) *int64 { return &v }

	d, err := s.QuotaDefaults(ctx)
	require.NoError(t, err)
	assert.Equal(t, Limits{}, d, "nothing set on a new store")

	_, err = s.UpdateQuotaDefaults(ctx, func(l *Limits) { l.VMs, l.Streams = n(5), n(0) })
	require.NoError(t, err)
	own, err := s.UpdateUserQuota(ctx, "u2", func(l *Limits) { l.VCPUs = n(8) })
	require.NoError(t, err)
	assert.Equal(t, Limits{VCPUs: n(8)}, own)
	own, err = s.UpdateUserQuota(ctx, "u2", func(l *Limits) { l.VCPUs, l.DiskGB = nil, n(100) })
	require.NoError(t, err)
	assert.Equal(t, Limits{DiskGB: n(100)}, own, "a cleared limit reads back as not set")

	_, err = s.UpdateUserQuota(ctx, "u-nobody", func(l *Limits) { l.VMs = n(1) })
	assert.True(t, errors.Is(err, ErrNotFound), "%v", err)

	s.Close()
	s2, err := Open(ctx, path)
	require.NoError(t, err)
	defer s2.Close()
	d, err = s2.QuotaDefaults(ctx)
	require.NoError(t, err)
	assert.Equal(t, Limits{VMs: n(5), Streams: n(0)}, d, "zero is a limit, kept as such")
	own, err = s2.UserQuota(ctx, "u2")
	require.NoError(t, err)
	assert.Equal(t, Limits{DiskGB: n(100)}, own)
	own, err = s2.UserQuota(ctx, "u1")
	require.NoError(t, err)
	assert.Equal(t, Limits{}, own)
}

func TestCountExposuresByOwnerCountsOnlyTheOwnersVMs(t *testing.T) {
	eachEngine(t, testCountExposuresByOwnerCountsOnlyTheOwnersVMs)
}

func testCountExposuresByOwnerCountsOnlyTheOwnersVMs(t *testing.T, e engine) {
	s, _ := e.open(t)
	fixture(t, s)
	ctx := context.Background()
	mustCreateVM(t, s, testVM("vm-a", "u1", "h1", "a", t0))
	mustCreateVM(t, s, testVM("vm-b", "u2", "h1", "b", t0))
	for i, vm := range []string{"vm-a", "vm-a", "vm-b"} {
		require.NoError(t, s.CreateExposure(ctx, Exposure{ID: "x" + string(rune('0'+i)), VMID: vm, HostID: "h1",
			GuestPort: 80, HostPort: uint16(30000 + i), Protocol: "tcp", Scope: "lan", CreatedAt: t0}))
	}
	n, err := s.CountExposuresByOwner(ctx, "u1")
	require.NoError(t, err)
	assert.EqualValues(t, 2, n)
	n, err = s.CountExposuresByOwner(ctx, "u2")
	require.NoError(t, err)
	assert.EqualValues(t, 1, n)
}
