package store

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestOneReplicaHoldsAHostsStreamAndTheSameAgentMayMoveToAnother(t *testing.T) {
	a, b := replicas(t)
	ctx := context.Background()
	fixture(t, a)
	const ttl = time.Minute

	conn1, err := a.ClaimHost(ctx, "h1", "agent-1", []byte("hello"), ttl)
	require.NoError(t, err)
	_, err = b.ClaimHost(ctx, "h1", "agent-2", nil, ttl)
	require.ErrorIs(t, err, ErrHeld, "a second agent process is refused on another replica too")

	lost, err := a.WriteLive(ctx, []LiveReport{{HostID: "h1", Conn: conn1, Report: []byte("r1")}}, ttl)
	require.NoError(t, err)
	assert.Empty(t, lost)
	rows, err := b.LiveAll(ctx)
	require.NoError(t, err)
	require.Len(t, rows, 1)
	assert.Equal(t, HostLive{HostID: "h1", Replica: a.Replica(), Instance: "agent-1", Conn: conn1, Connected: true,
		Hello: []byte("hello"), Report: []byte("r1"), Rev: rows[0].Rev}, rows[0])

	// The same agent reconnecting through b takes its host over at once;
	// a's stream is stale, and what a writes for it no longer lands.
	conn2, err := b.ClaimHost(ctx, "h1", "agent-1", []byte("hello again"), ttl)
	require.NoError(t, err)
	assert.Greater(t, conn2, conn1)
	lost, err = a.WriteLive(ctx, []LiveReport{{HostID: "h1", Conn: conn1, Report: []byte("stale")}}, ttl)
	require.NoError(t, err)
	assert.Equal(t, []string{"h1"}, lost)
	require.NoError(t, a.ReleaseHost(ctx, "h1", conn1))
	since, err := a.LiveSince(ctx, rows[0].Rev)
	require.NoError(t, err)
	require.Len(t, since, 1)
	assert.Equal(t, b.Replica(), since[0].Replica)
	assert.True(t, since[0].Connected, "a's late release did not close b's stream")
	assert.Nil(t, since[0].Report)

	require.NoError(t, b.ReleaseHost(ctx, "h1", conn2))
	_, err = a.ClaimHost(ctx, "h1", "agent-2", nil, ttl)
	require.NoError(t, err, "a released host may be claimed by any agent")
}

func TestADeadReplicasClaimLapses(t *testing.T) {
	a, b := replicas(t)
	ctx := context.Background()
	fixture(t, a)
	_, err := a.ClaimHost(ctx, "h1", "agent-1", nil, time.Millisecond)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		ids, err := b.LiveExpired(ctx)
		require.NoError(t, err)
		return len(ids) == 1 && ids[0] == "h1"
	}, 5*time.Second, 10*time.Millisecond)
	_, err = b.ClaimHost(ctx, "h1", "agent-2", nil, time.Minute)
	require.NoError(t, err, "nobody renewed a's claim")

	// Renewing keeps a live claim from lapsing.
	_, err = b.ClaimHost(ctx, "h2", "agent-3", nil, time.Millisecond)
	require.NoError(t, err)
	require.NoError(t, b.RenewClaims(ctx, time.Minute))
	ids, err := a.LiveExpired(ctx)
	require.NoError(t, err)
	assert.Empty(t, ids)
	_, err = a.ClaimHost(ctx, "h2", "agent-4", nil, time.Minute)
	assert.ErrorIs(t, err, ErrHeld)
}

func TestAClaimOnAnUnknownHostIsNotFound(t *testing.T) {
	a, _ := replicas(t)
	_, err := a.ClaimHost(context.Background(), "h-gone", "agent-1", nil, time.Minute)
	assert.ErrorIs(t, err, ErrNotFound)
}

// One flush carries several hosts: each is written or named lost on its
// own, and a host without a new usage sample keeps the one it had.
func TestOneLiveWriteCarriesSeveralHostsEachOnItsOwnTerms(t *testing.T) {
	a, b := replicas(t)
	ctx := context.Background()
	fixture(t, a)
	const ttl = time.Minute
	c1, err := a.ClaimHost(ctx, "h1", "agent-1", nil, ttl)
	require.NoError(t, err)
	c2, err := a.ClaimHost(ctx, "h2", "agent-2", nil, ttl)
	require.NoError(t, err)
	lost, err := a.WriteLive(ctx, []LiveReport{
		{HostID: "h1", Conn: c1, Report: []byte("r1"), Usage: []byte("u1")},
		{HostID: "h2", Conn: c2, Report: []byte("r2"), Usage: []byte("u2")},
	}, ttl)
	require.NoError(t, err)
	assert.Empty(t, lost)

	// h2 moves to b; a's next flush still lands h1's report, keeps h1's
	// usage (none came) and names h2 lost.
	_, err = b.ClaimHost(ctx, "h2", "agent-2", nil, ttl)
	require.NoError(t, err)
	lost, err = a.WriteLive(ctx, []LiveReport{
		{HostID: "h1", Conn: c1, Report: []byte("r1b")},
		{HostID: "h2", Conn: c2, Report: []byte("stale"), Usage: []byte("stale")},
	}, ttl)
	require.NoError(t, err)
	assert.Equal(t, []string{"h2"}, lost)
	rows, err := b.LiveAll(ctx)
	require.NoError(t, err)
	got := map[string]HostLive{}
	for _, r := range rows {
		got[r.HostID] = r
	}
	assert.Equal(t, []byte("r1b"), got["h1"].Report)
	assert.Equal(t, []byte("u1"), got["h1"].Usage, "a flush without a sample keeps the last one")
	assert.Equal(t, b.Replica(), got["h2"].Replica)
	assert.Nil(t, got["h2"].Report, "the stale stream's report did not land")
	assert.Nil(t, got["h2"].Usage)
}
