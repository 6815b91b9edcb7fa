// Package store holds the control plane's durable rows — users, tokens,
// hosts, join tokens, VMs, exposures and VM events — in an embedded SQLite
// database, or in a PostgreSQL database that several control-plane replicas
// share, with embedded, versioned migrations.
//
// The SQL is kept portable: positional $N placeholders, standard DDL, no
// upserts or SQLite-only functions, so both engines run the same queries.
// PostgreSQL's migrations are a dialect of the same numbered files
// (migrations/postgres: BLOB → BYTEA, rowid → identity, TEXT in the "C"
// collation so text sorts by bytes as in SQLite).
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
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
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

//go:embed migrations/*.sql migrations/postgres/*.sql
var migrationFS embed.FS

// Where each engine's migrations are in migrationFS.
const (
	sqliteMigrations   = "migrations"
	postgresMigrations = "migrations/postgres"
)

const busyTimeout = 10 * time.Second

// Store is the durable store. It is safe for concurrent use.
type Store struct {
	db *observedDB
	// wlock serializes writers inside this process: SQLite allows one writer
	// at a time, and queueing here (cancellable by ctx) is cheaper and more
	// predictable than contending on the file lock. Readers use the pool
	// freely; WAL lets them run beside the writer. Nil on PostgreSQL,
	// where writers run side by side (see writePostgres).
	wlock chan struct{}
	// pg: the database is PostgreSQL, else SQLite.
	pg  bool
	now func() time.Time
	// pgcfg opens the dedicated connections LISTEN needs (PostgreSQL only).
	pgcfg *pgx.ConnConfig
	// replica names this process in the change feed (changes.origin).
	replica string
	// listeners: Listen's goroutines, waited for by Close so no
	// connection outlives the store.
	listeners sync.WaitGroup
}

// Open opens the database db names and applies any pending migrations: a
// postgres:// or postgresql:// URL is a PostgreSQL database (see
// IsPostgres), anything else the path of a SQLite file, created if needed.
// A database whose schema is newer than this binary's migrations is
// refused with a *SchemaTooNewError.
func Open(ctx context.Context, db string) (*Store, error) {
	if IsPostgres(db) {
		return openPostgres(ctx, db)
	}
	return openSQLite(ctx, db)
}

func openSQLite(ctx context.Context, path string) (*Store, error) {
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

	unlock, err := lockOpening(ctx, path)
	if err != nil {
		return nil, err
	}
	defer unlock()
	db, err := openSQLiteDB(path + "?" + q.Encode())
	if err != nil {
		return nil, fmt.Errorf("store: open %s: %w", path, err)
	}
	// A few readers beside the single writer; SQLite gains nothing from more
	// on a small control plane.
	db.SetMaxOpenConns(8)
	db.SetMaxIdleConns(8)

	s := &Store{db: observe(db), wlock: make(chan struct{}, 1), now: func() time.Time { return time.Now().UTC() }}
	if err := s.start(ctx, path); err != nil {
		db.Close()
		return nil, err
	}
	return s, nil
}

// start checks the connection and brings the schema and the lineage row
// up to date; shown names the database in errors (no password).
func (s *Store) start(ctx context.Context, shown string) error {
	if err := s.db.PingContext(ctx); err != nil {
		return fmt.Errorf("store: open %s: %w", shown, err)
	}
	if err := s.migrate(ctx); err != nil {
		return err
	}
	if err := s.ensureLineage(ctx); err != nil {
		return fmt.Errorf("store: control plane lineage: %w", err)
	}
	return nil
}

// Close closes the database, once every Listen has ended with its context.
func (s *Store) Close() error {
	s.listeners.Wait() // they end with their contexts
	return s.db.Close()
}

type migration struct {
	version int
	name    string
	sql     string
}

// loadMigrations reads one engine's migrations from dir, by version.
func loadMigrations(dir string) ([]migration, error) {
	entries, err := fs.ReadDir(migrationFS, dir)
	if err != nil {
		return nil, err
	}
	var ms []migration
	seen := map[int]string{}
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
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
		body, err := fs.ReadFile(migrationFS, path.Join(dir, name))
		if err != nil {
			return nil, err
		}
		ms = append(ms, migration{version: v, name: name, sql: string(body)})
	}
	sort.Slice(ms, func(i, j int) bool { return ms[i].version < ms[j].version })
	return ms, nil
}

// schemaMigrationsDDL records the applied migrations, on both engines.
const schemaMigrationsDDL = `CREATE TABLE IF NOT EXISTS schema_migrations (
	version    INTEGER PRIMARY KEY,
	name       TEXT NOT NULL,
	applied_at BIGINT NOT NULL
)`

// SchemaTooNewError: the database has migrations this binary does not
// know, so a newer eitri wrote it, and this one could misread it.
type SchemaTooNewError struct {
	// At is the database's highest schema version; Known this binary's.
	At, Known int
}

func (e *SchemaTooNewError) Error() string {
	return fmt.Sprintf("database schema is at version %d; this eitri knows up to %d: upgrade eitri", e.At, e.Known)
}

// checkSchemaVersion returns the versions already applied, or a
// *SchemaTooNewError when any of them is not among ms.
func checkSchemaVersion(ctx context.Context, q queryer, ms []migration) (map[int]bool, error) {
	known, maxKnown := versions(ms)
	applied, at, err := appliedVersions(ctx, q)
	if err != nil {
		return nil, fmt.Errorf("store: %w", err)
	}
	for v := range applied {
		if !known[v] {
			return nil, fmt.Errorf("store: %w", &SchemaTooNewError{At: at, Known: maxKnown})
		}
	}
	return applied, nil
}

// versions returns the versions of ms, and the highest.
func versions(ms []migration) (map[int]bool, int) {
	out, top := map[int]bool{}, 0
	for _, m := range ms {
		out[m.version] = true
		top = max(top, m.version)
	}
	return out, top
}

// appliedVersions returns the versions schema_migrations records, and the
// highest (0 for none).
func appliedVersions(ctx context.Context, q queryer) (map[int]bool, int, error) {
	rows, err := q.QueryContext(ctx, `SELECT version FROM schema_migrations`)
	if err != nil {
		return nil, 0, fmt.Errorf("read schema_migrations: %w", err)
	}
	defer rows.Close()
	applied, at := map[int]bool{}, 0
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			return nil, 0, fmt.Errorf("read schema_migrations: %w", err)
		}
		applied[v] = true
		at = max(at, v)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, fmt.Errorf("read schema_migrations: %w", err)
	}
	return applied, at, nil
}

// migrate applies every embedded migration of the engine not yet recorded
// in schema_migrations, after refusing a schema newer than it knows. On
// SQLite each migration runs in its own transaction together with its
// record, so a crash leaves the schema at a whole version.
func (s *Store) migrate(ctx context.Context) error {
	dir := sqliteMigrations
	if s.pg {
		dir = postgresMigrations
	}
	ms, err := loadMigrations(dir)
	if err != nil {
		return err
	}
	if s.pg {
		return s.migratePostgres(ctx, ms)
	}
	if _, err := s.db.ExecContext(ctx, schemaMigrationsDDL); err != nil {
		return fmt.Errorf("store: create schema_migrations: %w", err)
	}
	if err := s.write(ctx, func(tx *sql.Tx) error {
		_, err := checkSchemaVersion(ctx, tx, ms)
		return err
	}); err != nil {
		return err
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

// write runs fn in a write transaction, one writer at a time (on SQLite;
// serializable on PostgreSQL, where fn may run more than once: see
// writePostgres). fn's error rolls the transaction back and is returned as
// is.
func (s *Store) write(ctx context.Context, fn func(tx *sql.Tx) error) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if s.pg {
		return s.writePostgres(ctx, fn)
	}
	waited := time.Now()
	select {
	case s.wlock <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	s.db.since(OpWriteWait, waited)
	defer func() { <-s.wlock }()
	return s.txOnce(ctx, nil, fn)
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
	return pgCode(err) == pgUniqueViolation
}

func isForeignKeyViolation(err error) bool {
	return sqliteCode(err) == sqlite3.SQLITE_CONSTRAINT_FOREIGNKEY || pgCode(err) == pgForeignKeyViolation
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
