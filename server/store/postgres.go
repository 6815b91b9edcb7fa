package store

import (
	"context"
	crand "crypto/rand"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// IsPostgres says whether db (what Open takes) names a PostgreSQL database
// rather than a SQLite file.
func IsPostgres(db string) bool {
	scheme, _, ok := strings.Cut(db, "://")
	return ok && (strings.EqualFold(scheme, "postgres") || strings.EqualFold(scheme, "postgresql"))
}

// Redact is db as it may be shown or logged: a PostgreSQL URL without its
// password (in the user part or the query), a SQLite path as is.
func Redact(db string) string {
	if !IsPostgres(db) {
		return db
	}
	u, err := url.Parse(db)
	if err != nil {
		// Unparsable: show only what it is, since where the password
		// sits cannot be told.
		scheme, _, _ := strings.Cut(db, "://")
		return scheme + "://(unparsable URL)"
	}
	if q := u.Query(); q.Has("password") {
		q.Set("password", "xxxxx")
		u.RawQuery = q.Encode()
	}
	return u.Redacted()
}

// PostgreSQL error codes the store acts on.
const (
	pgUniqueViolation      = "23505"
	pgForeignKeyViolation  = "23503"
	pgSerializationFailure = "40001"
	pgDeadlockDetected     = "40P01"
)

func pgCode(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

// migrationLock is the advisory lock key under which replicas apply
// migrations, one at a time ("eitri" and a 1, as bytes).
const migrationLock int64 = 0x65_69_74_72_69_00_01

// idleInTransaction is how long a replica's transaction may wait for the
// replica's next statement before PostgreSQL ends its session (see
// openPostgres).
const idleInTransaction = 10 * time.Second

// pgMaxAttempts bounds how often a write transaction is tried when
// PostgreSQL keeps failing to serialize it.
const pgMaxAttempts = 30

func openPostgres(ctx context.Context, dsn string) (*Store, error) {
	shown := Redact(dsn)
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("store: database URL %s: %w", shown, err)
	}
	if _, ok := cfg.RuntimeParams["application_name"]; !ok {
		cfg.RuntimeParams["application_name"] = "eitri"
	}
	// A replica frozen (SIGSTOP, a VM paused) or cut off inside a
	// transaction would keep its locks for as long as PostgreSQL keeps its
	// connection: the live lock, the change feed's, a row of control_plane
	// or hosts, and with them every other replica's writes. PostgreSQL ends
	// such a session once it has sat idle in its transaction this long,
	// far longer than any pause between the statements of a transaction
	// here, and shorter than a host's claim.
	if _, ok := cfg.RuntimeParams["idle_in_transaction_session_timeout"]; !ok {
		cfg.RuntimeParams["idle_in_transaction_session_timeout"] = strconv.FormatInt(idleInTransaction.Milliseconds(), 10)
	}
	// Every connection says which replica it writes for, so the change
	// feed's triggers can record whose write each change was.
	replica := crand.Text()
	cfg.RuntimeParams["eitri.replica"] = replica
	db := stdlib.OpenDB(*cfg)
	// Writers run side by side here (see writePostgres), so the pool is
	// what bounds a replica's share of the database's connections.
	db.SetMaxOpenConns(16)
	db.SetMaxIdleConns(8)
	db.SetConnMaxIdleTime(5 * time.Minute)
	s := &Store{db: observe(db), pg: true, now: func() time.Time { return time.Now().UTC() }, pgcfg: cfg, replica: replica}
	if err := s.start(ctx, shown); err != nil {
		db.Close()
		return nil, err
	}
	return s, nil
}

// migratePostgres applies the pending migrations in one transaction under
// a transaction-scoped advisory lock: replicas starting together queue
// there, the first applies what is missing, and the others find it done.
// PostgreSQL's DDL is transactional, so a crash applies all or nothing.
func (s *Store) migratePostgres(ctx context.Context, ms []migration) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return fmt.Errorf("store: migrate: %w", err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, migrationLock); err != nil {
		return fmt.Errorf("store: migrate: take the lock: %w", err)
	}
	if _, err := tx.ExecContext(ctx, schemaMigrationsDDL); err != nil {
		return fmt.Errorf("store: create schema_migrations: %w", err)
	}
	applied, err := checkSchemaVersion(ctx, tx, ms)
	if err != nil {
		return err
	}
	for _, m := range ms {
		if applied[m.version] {
			continue
		}
		if _, err := tx.ExecContext(ctx, m.sql); err != nil {
			return fmt.Errorf("store: migration %s: %w", m.name, err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)`,
			m.version, m.name, nanos(s.now())); err != nil {
			return fmt.Errorf("store: migration %s: %w", m.name, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return fmt.Errorf("store: migrate: %w", err)
	}
	return nil
}

// writePostgres runs fn in a SERIALIZABLE transaction, trying again while
// PostgreSQL reports a serialization failure or a deadlock.
//
// Serializable rather than explicit row locks: the store's read-then-write
// transactions check what no row lock can hold, the absence of a row (a
// free VM name, a free host port) and counts over many rows (a quota, a host's capacity; see
// CreateVMAdmitted), and serializable isolation keeps every such check
// true at commit, across replicas, including checks added later by
// someone who never thought about locking. The price is that fn may run
// more than once, so it must compute only from what it reads in tx (and
// the callbacks the store's methods take with it).
func (s *Store) writePostgres(ctx context.Context, fn func(tx *sql.Tx) error) error {
	return s.retryPostgres(ctx, sql.LevelSerializable, fn)
}

// writeCommitted runs fn in a READ COMMITTED transaction (PostgreSQL only),
// for the writes that check nothing across rows: live writes, ordered by
// the lock liveWrite takes, and calls. Each statement then reads what is
// committed when it starts, after the locks taken before it, so writers
// queued on a lock never fail to serialize. Under SERIALIZABLE the
// transaction's snapshot is taken before the lock wait, so each writer
// behind another that wrote the same rows failed and started over, and
// under load those retries took seconds. fn runs again only after a
// deadlock.
func (s *Store) writeCommitted(ctx context.Context, fn func(tx *sql.Tx) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	return s.retryPostgres(ctx, sql.LevelReadCommitted, fn)
}

// retryPostgres runs fn in a transaction at isolation level, trying again
// while PostgreSQL reports a serialization failure or a deadlock.
func (s *Store) retryPostgres(ctx context.Context, level sql.IsolationLevel, fn func(tx *sql.Tx) error) error {
	opts := &sql.TxOptions{Isolation: level}
	for attempt := 1; ; attempt++ {
		err := s.txOnce(ctx, opts, fn)
		switch code := pgCode(err); {
		case code != pgSerializationFailure && code != pgDeadlockDetected:
			return err
		case attempt == pgMaxAttempts:
			return fmt.Errorf("store: write still conflicting after %d attempts: %w", attempt, err)
		}
		// Jittered, growing backoff, so the transactions that collided do
		// not collide again in step.
		wait := time.Duration(rand.Int64N(int64(min(time.Millisecond<<min(attempt, 7), 100*time.Millisecond)))) + time.Millisecond
		select {
		case <-time.After(wait):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// txOnce runs fn in one transaction: fn's error rolls it back and is
// returned as is, else it commits.
func (s *Store) txOnce(ctx context.Context, opts *sql.TxOptions, fn func(tx *sql.Tx) error) error {
	defer s.db.since(OpTransaction, time.Now())
	tx, err := s.db.BeginTx(ctx, opts)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}
