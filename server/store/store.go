// Package store holds the control plane's durable rows — users, tokens,
// hosts, join tokens, VMs, exposures and VM events — in an embedded SQLite
// database with embedded, versioned migrations.
//
// The SQL is kept portable: positional $N placeholders, standard DDL, no
// upserts or SQLite-only functions, so a PostgreSQL backend later needs only
// a dialect pass over the migrations (BLOB → BYTEA, rowid → identity).
//
// Times are stored as BIGINT unix nanoseconds. Every time read back is in
// UTC with nanosecond precision and no monotonic clock reading, so
// t.UTC().Round(0) of what was written compares equal with ==, and any
// written time compares equal with Equal.
package store

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"
)

var (
	// ErrNotFound: the row asked for does not exist.
	ErrNotFound = errors.New("not found")
	// ErrConflict: a write would break a uniqueness rule, or a row is still
	// referenced. Errors wrap it with the detail.
	ErrConflict = errors.New("conflict")
	// ErrJoinTokenUsed: the join token already enrolled a host.
	ErrJoinTokenUsed = errors.New("join token already used")
	// ErrJoinTokenExpired: the join token's expiry has passed.
	ErrJoinTokenExpired = errors.New("join token expired")
)

//go:embed migrations/*.sql
var migrationFS embed.FS

const busyTimeout = 10 * time.Second

// Store is the durable store. It is safe for concurrent use.
type Store struct {
	db *sql.DB
	// wlock serializes writers inside this process: SQLite allows one writer
	// at a time, and queueing here (cancellable by ctx) is cheaper and more
	// predictable than contending on the file lock. Readers use the pool
	// freely; WAL lets them run beside the writer.
	wlock chan struct{}
	now   func() time.Time
}

// Open opens (creating if needed) the database file at path and applies any
// pending migrations.
func Open(ctx context.Context, path string) (*Store, error) {
	if path == "" || strings.ContainsAny(path, "?#") || path == ":memory:" {
		return nil, fmt.Errorf("store: invalid database path %q", path)
	}
	q := url.Values{}
	q.Add("_pragma", "busy_timeout("+strconv.FormatInt(busyTimeout.Milliseconds(), 10)+")")
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "foreign_keys(1)")
	// FULL: a commit is on disk before it is acknowledged, also across an OS
	// crash or power loss. NORMAL (WAL) could lose the last commits, and a
	// control plane that forgets a VM it created, or a generation it sent,
	// makes agents fence it off. The cost is an fsync per write
	// transaction, small beside what a control plane writes.
	q.Add("_pragma", "synchronous(FULL)")
	// Write transactions take the write lock at BEGIN, so a read-then-write
	// transaction can never fail midway on a lock upgrade.
	q.Set("_txlock", "immediate")

	db, err := sql.Open("sqlite", path+"?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("store: open %s: %w", path, err)
	}
	// A few readers beside the single writer; SQLite gains nothing from more
	// on a small control plane.
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)

	s := &Store{db: db, wlock: make(chan struct{}, 1), now: func() time.Time { return time.Now().UTC() }}
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("store: open %s: %w", path, err)
	}
	if err := s.migrate(ctx); err != nil {
		db.Close()
		return nil, err
	}
	if err := s.ensureLineage(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("store: control plane lineage: %w", err)
	}
	return s, nil
}

// Close closes the database.
func (s *Store) Close() error { return s.db.Close() }

type migration struct {
	version int
	name    string
	sql     string
}

func loadMigrations() ([]migration, error) {
	entries, err := fs.ReadDir(migrationFS, "migrations")
	if err != nil {
		return nil, err
	}
	var ms []migration
	seen := map[int]string{}
	for _, e := range entries {
		name := e.Name()
		prefix, _, ok := strings.Cut(name, "_")
		if !ok || !strings.HasSuffix(name, ".sql") {
			return nil, fmt.Errorf("store: migration %q is not named NNNN_name.sql", name)
		}
		v, err := strconv.Atoi(prefix)
		if err != nil || v <= 0 {
			return nil, fmt.Errorf("store: migration %q has no positive version", name)
		}
		if other, dup := seen[v]; dup {
			return nil, fmt.Errorf("store: migrations %q and %q share version %d", other, name, v)
		}
		seen[v] = name
		body, err := fs.ReadFile(migrationFS, path.Join("migrations", name))
		if err != nil {
			return nil, err
		}
		ms = append(ms, migration{version: v, name: name, sql: string(body)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].version < ms[j].version })
	return ms, nil
}

// migrate applies every embedded migration not yet recorded in
// schema_migrations, each in its own transaction together with its record,
// so a crash leaves the schema at a whole version.
func (s *Store) migrate(ctx context.Context) error {
	ms, err := loadMigrations()
	if err != nil {
		return err
	}
	if _, err := s.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version    INTEGER PRIMARY KEY,
		name       TEXT NOT NULL,
		applied_at BIGINT NOT NULL
	)`); err != nil {
		return fmt.Errorf("store: create schema_migrations: %w", err)
	}
	for _, m := range ms {
		err := s.write(ctx, func(tx *sql.Tx) error {
			// Checked inside the transaction: another process may have
			// applied it since we looked.
			var n int
			if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM schema_migrations WHERE version = $1`, m.version).Scan(&n); err != nil {
				return err
			}
			if n > 0 {
				return nil
			}
			if _, err := tx.ExecContext(ctx, m.sql); err != nil {
				return err
			}
			_, err := tx.ExecContext(ctx, `INSERT INTO schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)`,
				m.version, m.name, nanos(s.now()))
			return err
		})
		if err != nil {
			return fmt.Errorf("store: migration %s: %w", m.name, err)
		}
	}
	return nil
}

// write runs fn in a write transaction, one writer at a time. fn's error
// rolls the transaction back and is returned as is.
func (s *Store) write(ctx context.Context, fn func(tx *sql.Tx) error) error {
	select {
	case s.wlock <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-s.wlock }()

	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// queryer is what both *sql.DB and *sql.Tx offer, so row loaders serve
// plain reads and transactions alike.
type queryer interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// --- time and NULL helpers ---

func nanos(t time.Time) int64 { return t.UnixNano() }

func fromNanos(n int64) time.Time { return time.Unix(0, n).UTC() }

func nullNanos(t *time.Time) sql.NullInt64 {
	if t == nil {
		return sql.NullInt64{}
	}
	return sql.NullInt64{Int64: t.UnixNano(), Valid: true}
}

func fromNullNanos(n sql.NullInt64) *time.Time {
	if !n.Valid {
		return nil
	}
	t := fromNanos(n.Int64)
	return &t
}

// nullString maps the Go zero value "" to NULL, for optional references.
func nullString(s string) sql.NullString {
	return sql.NullString{String: s, Valid: s != ""}
}

// orNow fills a zero creation time.
func (s *Store) orNow(t time.Time) time.Time {
	if t.IsZero() {
		return s.now()
	}
	return t
}

// --- error classification ---

func sqliteCode(err error) int {
	var se *sqlite.Error
	if errors.As(err, &se) {
		return se.Code()
	}
	return 0
}

func isUniqueViolation(err error) bool {
	switch sqliteCode(err) {
	case sqlite3.SQLITE_CONSTRAINT_UNIQUE, sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY:
		return true
	}
	return false
}

func isForeignKeyViolation(err error) bool {
	return sqliteCode(err) == sqlite3.SQLITE_CONSTRAINT_FOREIGNKEY
}

// notFound turns sql.ErrNoRows into ErrNotFound with what was looked for.
func notFound(err error, what string) error {
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("%w: %s", ErrNotFound, what)
	}
	return err
}

// mustAffect reports ErrNotFound when an UPDATE or DELETE touched no row.
func mustAffect(res sql.Result, err error, what string) error {
	if err != nil {
		return err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return err
	}
	if n == 0 {
		return fmt.Errorf("%w: %s", ErrNotFound, what)
	}
	return nil
}
