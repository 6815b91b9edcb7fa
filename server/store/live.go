package store

import (
	"context"
	"database/sql"
	"errors"
	"time"
)

// Live state across replicas (PostgreSQL only): the host_live table says
// which replica holds each host's agent stream, under a claim the holder
// renews and a dead replica's lapses, and carries the host's last hello
// and report so every other replica can show what the host said. The
// claim is what keeps one stream per host in the whole fleet: a second
// agent process is refused wherever it connects, while the same process
// reconnecting through another replica takes its host over at once.

// LiveChannel is the NOTIFY channel live writes wake followers on.
const LiveChannel = "eitri_live"

// ErrHeld: another replica holds the host's stream for another agent
// process, and its claim has not lapsed.
var ErrHeld = errors.New("host held by another replica")

// liveLock numbers live writes in commit order (as the change feed's
// triggers do theirs): "eitri" and a 3, as bytes.
const liveLock int64 = 0x65_69_74_72_69_00_03

// dbNow is the database's clock in unix nanoseconds: claims are compared
// on one clock, whatever the replicas' own say.
const dbNow = `(extract(epoch FROM clock_timestamp()) * 1000000000)::bigint`

// HostLive is one host's row.
type HostLive struct {
	HostID, Replica, Instance string
	// Conn rises with every stream the host opens, on any replica.
	Conn      int64
	Connected bool
	// Expired: the holder's claim lapsed (it stopped renewing).
	Expired bool
	// Hello, Report and Usage (the newest UsageSample) are the wire
	// messages, marshalled.
	Hello, Report, Usage []byte
	Rev                  int64
}

// ClaimHost makes this replica the holder of hostID's stream for the agent
// process instance and returns the stream's conn number. It is refused
// with ErrHeld while another replica holds the host for another live agent
// process (an empty instance, from older agents, matches any).
func (s *Store) ClaimHost(ctx context.Context, hostID, instance string, hello []byte, ttl time.Duration) (int64, error) {
	var conn int64
	err := s.liveWrite(ctx, func(tx *sql.Tx) error {
		err := tx.QueryRowContext(ctx, `INSERT INTO host_live (host_id, replica, instance, conn, connected, expires_at, hello, report, rev)
			VALUES ($1, $2, $3, nextval('host_live_conn'), TRUE, `+dbNow+` + $4, $5, NULL, nextval('host_live_rev'))
			ON CONFLICT (host_id) DO UPDATE SET replica = EXCLUDED.replica, instance = EXCLUDED.instance, conn = EXCLUDED.conn,
				connected = TRUE, expires_at = EXCLUDED.expires_at, hello = EXCLUDED.hello, report = NULL, usage = NULL,
				image_cache = NULL, image_cache_at = NULL, rev = EXCLUDED.rev
			WHERE host_live.replica = EXCLUDED.replica OR host_live.instance = EXCLUDED.instance
				OR host_live.instance = '' OR EXCLUDED.instance = ''
				OR NOT host_live.connected OR host_live.expires_at < `+dbNow+`
			RETURNING conn`, hostID, s.replica, instance, ttl.Nanoseconds(), hello).Scan(&conn)
		if errors.Is(err, sql.ErrNoRows) {
			return ErrHeld
		}
		if isForeignKeyViolation(err) {
			return ErrNotFound
		}
		return err
	})
	return conn, err
}

// HoldsHost says whether this replica still holds hostID's stream conn:
// nobody took the host over, and the claim has not lapsed. What a replica
// sends a host is fenced by it, so one that was frozen or cut off and
// comes back never acts for a host another replica now serves.
func (s *Store) HoldsHost(ctx context.Context, hostID string, conn int64) (bool, error) {
	var ok bool
	err := s.db.QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM host_live WHERE host_id = $1 AND replica = $2 AND conn = $3
		AND connected AND expires_at >= `+dbNow+`)`, hostID, s.replica, conn).Scan(&ok)
	return ok, err
}

// LiveReport is a report to publish for a host this replica holds, and
// its newest usage sample when one came since the last write (nil keeps
// the one written before).
type LiveReport struct {
	HostID        string
	Conn          int64
	Report, Usage []byte
}

// WriteLive publishes reports of hosts this replica holds, in one
// transaction, renewing their claims. It returns the hosts whose claim this
// replica no longer holds (another took the host over): their streams here
// are stale.
func (s *Store) WriteLive(ctx context.Context, reps []LiveReport, ttl time.Duration) (lost []string, err error) {
	if !s.pg {
		return nil, errors.New("store: live state is shared only on PostgreSQL")
	}
	ids := make([]string, len(reps))
	conns := make([]int64, len(reps))
	reports := make([][]byte, len(reps))
	usages := make([][]byte, len(reps))
	for i, r := range reps {
		ids[i], conns[i], reports[i], usages[i] = r.HostID, r.Conn, r.Report, r.Usage
	}
	// One statement, its own transaction, for every host whatever their
	// number: a flush is one round trip. The lock is taken before any row
	// is numbered (each joined row needs the lock's), as liveWrite's is.
	rows, err := s.db.QueryContext(ctx, `WITH live_lock AS MATERIALIZED (
			SELECT pg_advisory_xact_lock($7), set_config('synchronous_commit', 'off', true), pg_notify($8, ''))
		UPDATE host_live SET report = w.report, usage = COALESCE(w.usage, host_live.usage),
			rev = nextval('host_live_rev'), expires_at = `+dbNow+` + $5
		FROM unnest($1::text[], $2::bigint[], $3::bytea[], $4::bytea[]) AS w(host_id, conn, report, usage), live_lock
		WHERE host_live.host_id = w.host_id AND host_live.replica = $6 AND host_live.conn = w.conn AND host_live.connected
		RETURNING host_live.host_id`, ids, conns, reports, usages, ttl.Nanoseconds(), s.replica, liveLock, LiveChannel)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	written := make(map[string]bool, len(reps))
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		written[id] = true
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	for _, id := range ids {
		if !written[id] {
			lost = append(lost, id)
		}
	}
	return lost, nil
}

// WriteLiveImageCache keeps the image cache listing hostID sent on its
// stream conn here, for the other replicas to answer with. Not a live
// write: nobody follows it; they read it when asked.
func (s *Store) WriteLiveImageCache(ctx context.Context, hostID string, conn int64, listing []byte, at time.Time) error {
	if !s.pg {
		return errors.New("store: live state is shared only on PostgreSQL")
	}
	_, err := s.db.ExecContext(ctx, `UPDATE host_live SET image_cache = $1, image_cache_at = $2
		WHERE host_id = $3 AND replica = $4 AND conn = $5 AND connected`, listing, at.UnixNano(), hostID, s.replica, conn)
	return err
}

// LiveImageCache is the image cache listing hostID's holder keeps, and
// when it came; ok is false while the host is not connected or has sent
// none.
func (s *Store) LiveImageCache(ctx context.Context, hostID string) (listing []byte, at time.Time, ok bool, err error) {
	var ns sql.NullInt64
	err = s.db.QueryRowContext(ctx, `SELECT image_cache, image_cache_at FROM host_live
		WHERE host_id = $1 AND connected AND expires_at >= `+dbNow+` AND image_cache IS NOT NULL`, hostID).Scan(&listing, &ns)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, time.Time{}, false, nil
	}
	if err != nil {
		return nil, time.Time{}, false, err
	}
	return listing, time.Unix(0, ns.Int64).UTC(), true, nil
}

// ReleaseHost marks the stream conn of hostID closed, if it is still the
// host's current one here.
func (s *Store) ReleaseHost(ctx context.Context, hostID string, conn int64) error {
	return s.liveWrite(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `UPDATE host_live SET connected = FALSE, report = NULL, usage = NULL, image_cache = NULL, image_cache_at = NULL,
			rev = nextval('host_live_rev')
			WHERE host_id = $1 AND replica = $2 AND conn = $3`, hostID, s.replica, conn)
		return err
	})
}

// RenewClaims extends every claim this replica holds.
func (s *Store) RenewClaims(ctx context.Context, ttl time.Duration) error {
	_, err := s.db.ExecContext(ctx, `UPDATE host_live SET expires_at = `+dbNow+` + $1 WHERE replica = $2 AND connected`,
		ttl.Nanoseconds(), s.replica)
	return err
}

// LiveSince returns the rows written after revision after, oldest first,
// each as it is now.
func (s *Store) LiveSince(ctx context.Context, after int64) ([]HostLive, error) {
	return s.queryLive(ctx, `WHERE rev > $1 ORDER BY rev`, after)
}

// LiveAll returns every row, for a follower starting over.
func (s *Store) LiveAll(ctx context.Context) ([]HostLive, error) {
	return s.queryLive(ctx, `ORDER BY rev`)
}

func (s *Store) queryLive(ctx context.Context, where string, args ...any) ([]HostLive, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT host_id, replica, instance, conn, connected, expires_at < `+dbNow+`, hello, report, usage, rev
		FROM host_live `+where, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []HostLive
	for rows.Next() {
		var l HostLive
		if err := rows.Scan(&l.HostID, &l.Replica, &l.Instance, &l.Conn, &l.Connected, &l.Expired, &l.Hello, &l.Report, &l.Usage, &l.Rev); err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	return out, rows.Err()
}

// LiveExpired returns the hosts shown connected whose holder's claim has
// lapsed: a replica that died or froze. Followers show them disconnected.
func (s *Store) LiveExpired(ctx context.Context) ([]string, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT host_id FROM host_live WHERE connected AND expires_at < `+dbNow)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			return nil, err
		}
		out = append(out, id)
	}
	return out, rows.Err()
}

// liveWrite runs fn as a live write: numbered in commit order (the lock,
// held to commit), without waiting for the disk (live state is rebuilt from
// the agents if lost), and waking followers (sent at commit). Read
// committed (see writeCommitted): the lock orders live writes, and
// ClaimHost's ON CONFLICT … WHERE decides atomically on the row as it is.
func (s *Store) liveWrite(ctx context.Context, fn func(tx *sql.Tx) error) error {
	if !s.pg {
		return errors.New("store: live state is shared only on PostgreSQL")
	}
	return s.writeCommitted(ctx, func(tx *sql.Tx) error {
		// One round trip for the three: the lock, the commit that does not
		// wait for the disk, and the wake-up, which PostgreSQL sends only
		// if the transaction commits.
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1), set_config('synchronous_commit', 'off', true), pg_notify($2, '')`,
			liveLock, LiveChannel); err != nil {
			return err
		}
		return fn(tx)
	})
}
