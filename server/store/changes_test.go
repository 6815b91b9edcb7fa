package store

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// replicas opens two stores on one new PostgreSQL database, as two
// control-plane replicas would.
func replicas(t *testing.T) (a, b *Store) {
	t.Helper()
	pg := engines[1]
	a, db := pg.open(t)
	b, err := Open(context.Background(), db)
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	return a, b
}

func TestTheChangeFeedRecordsEveryWriteWithItsReplica(t *testing.T) {
	a, b := replicas(t)
	ctx := context.Background()
	require.NotEqual(t, a.Replica(), b.Replica())
	_, start, err := b.ChangeBounds(ctx)
	require.NoError(t, err)

	fixture(t, a) // two hosts
	mustCreateVM(t, a, testVM("v1", "u2", "h1", "web-1", t0))
	_, _, err = b.UpdateVM(ctx, "v1", func(v *VM) error { v.PowerState = "stopped"; return nil })
	require.NoError(t, err)
	require.NoError(t, a.TouchHost(ctx, "h1", t0.Add(time.Minute)))
	require.NoError(t, a.DeleteVM(ctx, "v1"))

	got, err := b.Changes(ctx, start, 100)
	require.NoError(t, err)
	type seen struct {
		kind, id, host, owner string
		removed               bool
		mine                  bool // written through a
	}
	var rows []seen
	for i, c := range got {
		if i > 0 {
			assert.Greater(t, c.Rev, got[i-1].Rev)
		}
		rows = append(rows, seen{c.Kind, c.ID, c.HostID, c.OwnerID, c.Removed, c.Origin == a.Replica()})
	}
	assert.Equal(t, []seen{
		{ChangeHost, "h1", "h1", "", false, true},
		{ChangeHost, "h2", "h2", "", false, true},
		{ChangeVM, "v1", "h1", "u2", false, true},
		{ChangeVM, "v1", "h1", "u2", false, false},
		// The heartbeat is no change; the removal carries its owner.
		{ChangeVM, "v1", "h1", "u2", true, true},
	}, rows)

	oldest, newest, err := b.ChangeBounds(ctx)
	require.NoError(t, err)
	assert.Equal(t, got[0].Rev, oldest)
	assert.Equal(t, got[len(got)-1].Rev, newest)
	n, err := a.PruneChanges(ctx, 0)
	require.NoError(t, err)
	assert.EqualValues(t, len(got), n)
	rest, err := b.Changes(ctx, 0, 100)
	require.NoError(t, err)
	assert.Empty(t, rest)
}

func TestAListenerIsWokenByAnotherReplicasWrite(t *testing.T) {
	a, b := replicas(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	wake := b.Listen(ctx, ChangesChannel)
	select {
	case <-wake: // the first connect: catch up
	case <-time.After(10 * time.Second):
		t.Fatal("no wake-up on connecting")
	}
	fixture(t, a)
	select {
	case <-wake:
	case <-time.After(10 * time.Second):
		t.Fatal("no wake-up for another replica's write")
	}
}

// Revisions are taken in commit order: a follower that has read up to N
// never later finds a change numbered below N. A write still open when
// another replica writes is the case that would break it: numbered first,
// committed last.
func TestAFollowerNeverMissesAChangeCommittedAfterALaterNumberedOne(t *testing.T) {
	a, b := replicas(t)
	ctx := context.Background()
	fixture(t, a)
	_, after, err := b.ChangeBounds(ctx)
	require.NoError(t, err)

	slow, err := a.db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer slow.Rollback()
	_, err = slow.ExecContext(ctx, `UPDATE hosts SET name = 'renamed' WHERE id = 'h1'`)
	require.NoError(t, err)

	wrote := make(chan error, 1)
	go func() {
		_, err := b.CreateVM(ctx, testVM("v1", "u2", "h2", "web-1", t0))
		wrote <- err
	}()
	seen := 0
	follow := func() {
		got, err := b.Changes(ctx, after, 100)
		require.NoError(t, err)
		for _, c := range got {
			after = c.Rev
			seen++
		}
	}
	// Follow for a while with the first write open: whatever shows up moves
	// the follower past it.
	for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); {
		follow()
	}
	require.NoError(t, slow.Commit())
	require.NoError(t, <-wrote)
	follow()
	assert.Equal(t, 2, seen, "the follower saw the rename and the create")
}

// A pull, its end and a new version are in the feed, so the replica that
// holds each host can send it a new snapshot; an image added or removed
// is too, for the catalogue's watchers on every replica.
func TestTheChangeFeedRecordsImagePullsAndNewVersions(t *testing.T) {
	a, b := replicas(t)
	ctx := context.Background()
	_, start, err := b.ChangeBounds(ctx)
	require.NoError(t, err)

	require.NoError(t, a.CreateImage(ctx, Image{Name: "debian-12", URL: "https://example.org/a"}, ImageVersion{URL: "https://example.org/a", SHA256: "aa"}))
	require.NoError(t, a.AddImagePulls(ctx, "debian-12", []string{"h1"}))
	_, _, err = a.AdvanceImage(ctx, "debian-12", ImageVersion{URL: "https://example.org/a", SHA256: "aa"}, 5)
	require.NoError(t, err, "the same digest: no new version")
	_, _, err = a.AdvanceImage(ctx, "debian-12", ImageVersion{URL: "https://example.org/b", SHA256: "bb"}, 5)
	require.NoError(t, err)
	require.NoError(t, a.DeleteImage(ctx, "debian-12"))

	got, err := b.Changes(ctx, start, 100)
	require.NoError(t, err)
	type seen struct {
		kind, id, host string
		removed        bool
	}
	var rows []seen
	for _, c := range got {
		rows = append(rows, seen{c.Kind, c.ID, c.HostID, c.Removed})
	}
	assert.Equal(t, []seen{
		{ChangeImage, "debian-12", "", false}, // added
		{ChangeImagePull, "debian-12", "h1", false},
		{ChangeImage, "debian-12", "", false}, // a new version
		{ChangeImage, "debian-12", "", true},  // removed, and with it its pulls
		{ChangeImagePull, "debian-12", "h1", true},
	}, rows)
}
