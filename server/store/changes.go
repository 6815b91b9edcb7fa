package store

import (
	"context"
	"database/sql"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
)

// The change feed: on PostgreSQL, triggers record every write of a VM, host
// or exposure in the changes table, in the writing transaction, numbered in
// commit order (see migrations/postgres/0007_changes.sql). Replicas follow
// it from the revision they have reached, so a replica that was away (its
// database connection lost, its process frozen) catches up from where it
// was. NOTIFY on channel ChangesChannel only wakes followers: notifications
// are lost while a listener reconnects, so the table is the truth.
//
// A SQLite control plane is one process and publishes its own writes; its
// feed is always empty.

// Kinds of object a Change is about.
const (
	ChangeVM       = "vm"
	ChangeHost     = "host"
	ChangeExposure = "exposure"
	// ChangeImagePull: an image (ID, its name) pulled to a host, or no
	// longer. ChangeImage: an image (ID) added, removed (Removed) or moved
	// to a new current version.
	ChangeImagePull = "image_pull"
	ChangeImage     = "image"
)

// ChangesChannel is the NOTIFY channel the triggers wake followers on.
const ChangesChannel = "eitri_changes"

// Change is one recorded write.
type Change struct {
	Rev  int64
	Kind string
	ID   string
	// HostID is the host the object lives on (a host's own id for a host);
	// OwnerID a VM's owner. Either may be empty.
	HostID, OwnerID string
	Removed         bool
	// Origin is the replica whose write it was (see Replica).
	Origin string
	At     time.Time
}

// Replica is this process's name in the change feed: a follower skips the
// changes it wrote itself, having published them as it wrote them. Empty on
// SQLite.
func (s *Store) Replica() string { return s.replica }

// Shared says whether other processes may write this database (PostgreSQL),
// so the change feed must be followed.
func (s *Store) Shared() bool { return s.pg }

// Changes returns up to limit changes after revision after, oldest first.
func (s *Store) Changes(ctx context.Context, after int64, limit int) ([]Change, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT rev, kind, id, host_id, owner_id, removed, origin, at
		FROM changes WHERE rev > $1 ORDER BY rev LIMIT $2`, after, limit)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Change
	for rows.Next() {
		var c Change
		var host, owner sql.NullString
		var at int64
		if err := rows.Scan(&c.Rev, &c.Kind, &c.ID, &host, &owner, &c.Removed, &c.Origin, &at); err != nil {
			return nil, err
		}
		c.HostID, c.OwnerID, c.At = host.String, owner.String, fromNanos(at)
		out = append(out, c)
	}
	return out, rows.Err()
}

// ChangeBounds returns the oldest revision still kept and the newest
// written (0, 0 for an empty feed). A follower behind oldest-1 has missed
// pruned changes and must read everything anew.
func (s *Store) ChangeBounds(ctx context.Context) (oldest, newest int64, err error) {
	var lo, hi sql.NullInt64
	err = s.db.QueryRowContext(ctx, `SELECT min(rev), max(rev) FROM changes`).Scan(&lo, &hi)
	return lo.Int64, hi.Int64, err
}

// PruneChanges drops changes recorded longer ago than keep, by the
// database's clock (the one that stamped them). Any replica may run it
// (deleting twice is harmless); a follower that far behind resyncs.
func (s *Store) PruneChanges(ctx context.Context, keep time.Duration) (int64, error) {
	if !s.pg {
		return 0, nil
	}
	res, err := s.db.ExecContext(ctx, `DELETE FROM changes WHERE at < `+dbNow+` - $1`, keep.Nanoseconds())
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}

// listenRetry bounds how long a lost LISTEN connection waits before trying
// again.
const listenRetry = time.Second

// Listen returns a channel that is sent a wake-up (coalesced) whenever
// PostgreSQL delivers a notification on channel, and also every time the
// listening connection is (re)established, since notifications sent while
// it was down are lost: the receiver then catches up from the table. It
// keeps a dedicated connection until ctx ends. On SQLite nothing is ever
// sent.
func (s *Store) Listen(ctx context.Context, channel string) <-chan struct{} {
	wake := make(chan struct{}, 1)
	if !s.pg {
		return wake
	}
	poke := func() {
		select {
		case wake <- struct{}{}:
		default:
		}
	}
	s.listeners.Add(1)
	go func() {
		defer s.listeners.Done()
		for ctx.Err() == nil {
			err := s.listenOnce(ctx, channel, poke)
			if ctx.Err() != nil {
				return
			}
			_ = err // the follower's timer covers the gap; try again soon
			select {
			case <-ctx.Done():
				return
			case <-time.After(listenRetry):
			}
		}
	}()
	return wake
}

func (s *Store) listenOnce(ctx context.Context, channel string, poke func()) error {
	conn, err := pgx.ConnectConfig(ctx, s.pgcfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		return err
	}
	poke() // whatever was sent before this LISTEN is in the table
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			if errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		}
		poke()
	}
}
