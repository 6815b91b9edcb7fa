package store

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestReleases(t *testing.T) { eachEngine(t, testReleases) }

func testReleases(t *testing.T, e engine) {
	ctx := context.Background()
	s, _ := e.open(t)
	data := bytes.Repeat([]byte{0, 1, 2, 0xff}, 1<<18) // a MiB, with bytes no text column would keep
	r := Release{SHA256: "aa", Version: "v1.4", OS: "linux", Arch: "amd64", Size: int64(len(data)), KeyID: "ed25519:01",
		Signature: []byte("{}"), UploadedBy: "u1", UploadedAt: time.Unix(100, 0).UTC()}
	require.NoError(t, s.CreateRelease(ctx, r, data))

	got, err := s.ReleaseFor(ctx, "v1.4", "linux", "amd64")
	require.NoError(t, err)
	assert.Equal(t, r, got)
	back, err := s.ReleaseData(ctx, "aa")
	require.NoError(t, err)
	assert.True(t, bytes.Equal(data, back), "the build's bytes come back exactly")

	again := r
	again.SHA256 = "bb"
	assert.ErrorIs(t, s.CreateRelease(ctx, again, data), ErrConflict, "one build per version and platform")
	other := again
	other.Arch = "arm64"
	require.NoError(t, s.CreateRelease(ctx, other, data))

	list, err := s.ListReleases(ctx)
	require.NoError(t, err)
	assert.Len(t, list, 2)

	require.NoError(t, s.DeleteRelease(ctx, "aa"))
	_, err = s.ReleaseBySHA256(ctx, "aa")
	assert.ErrorIs(t, err, ErrNotFound)
	assert.ErrorIs(t, s.DeleteRelease(ctx, "aa"), ErrNotFound)
}

func TestRollouts(t *testing.T) { eachEngine(t, testRollouts) }

func testRollouts(t *testing.T, e engine) {
	ctx := context.Background()
	s, _ := e.open(t)
	r := Rollout{ID: "r1", Version: "v1.4", State: RolloutCanary, MaxUnavailable: 2, CreatedBy: "u1",
		Hosts: []RolloutHost{{HostID: "h1", HostName: "a", State: HostPending}, {HostID: "h2", HostName: "b", State: HostPending}}}
	require.NoError(t, s.CreateRollout(ctx, r))
	assert.ErrorIs(t, s.CreateRollout(ctx, Rollout{ID: "r2", Version: "v1.5", State: RolloutCanary}), ErrConflict,
		"one active rollout at a time")

	active, ok, err := s.ActiveRollout(ctx)
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, "r1", active.ID)

	started := time.Unix(200, 0).UTC()
	got, changed, err := s.UpdateRollout(ctx, "r1", func(r *Rollout) error {
		r.Hosts[0].State, r.Hosts[0].StartedAt, r.Hosts[0].Attempt = HostUpgrading, &started, 1
		return nil
	})
	require.NoError(t, err)
	assert.True(t, changed)
	assert.Equal(t, HostUpgrading, got.Hosts[0].State)
	_, changed, err = s.UpdateRollout(ctx, "r1", func(r *Rollout) error { return nil })
	require.NoError(t, err)
	assert.False(t, changed, "nothing changed, nothing written")

	read, err := s.GetRollout(ctx, "r1")
	require.NoError(t, err)
	assert.Equal(t, started, *read.Hosts[0].StartedAt)
	assert.Equal(t, HostPending, read.Hosts[1].State)

	_, _, err = s.UpdateRollout(ctx, "r1", func(r *Rollout) error { r.State = RolloutAborted; return nil })
	require.NoError(t, err)
	_, ok, err = s.ActiveRollout(ctx)
	require.NoError(t, err)
	assert.False(t, ok)
	require.NoError(t, s.CreateRollout(ctx, Rollout{ID: "r2", Version: "v1.5", State: RolloutCanary}), "the next may start once it ended")
	list, err := s.ListRollouts(ctx)
	require.NoError(t, err)
	assert.Len(t, list, 2)
}

func TestHostUpgradeAndPlatform(t *testing.T) { eachEngine(t, testHostUpgradeAndPlatform) }

func testHostUpgradeAndPlatform(t *testing.T, e engine) {
	ctx := context.Background()
	s, _ := e.open(t)
	require.NoError(t, s.CreateHost(ctx, Host{ID: "h1", Name: "a", CredentialHash: []byte("c")}))
	h, err := s.HostByID(ctx, "h1")
	require.NoError(t, err)
	assert.Zero(t, h.Upgrade, "never offered")

	require.NoError(t, s.UpdateHostHello(ctx, "h1", HostHello{AgentVersion: "v1.3", OS: "linux", Arch: "amd64"}, time.Unix(10, 0)))
	u := HostUpgrade{Target: "v1.4", Step: "failed", Error: "exited at start", RolloutID: "r1", Attempt: 1, Since: time.Unix(20, 0).UTC()}
	require.NoError(t, s.SetHostUpgrade(ctx, "h1", u))
	h, err = s.HostByID(ctx, "h1")
	require.NoError(t, err)
	assert.Equal(t, "linux", h.OS)
	assert.Equal(t, "amd64", h.Arch)
	assert.Equal(t, u, h.Upgrade)
}
