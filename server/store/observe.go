package store

import (
	"context"
	"database/sql"
	"sync/atomic"
	"time"
)

// Op is a kind of work the store times for its Observer. The set is fixed:
// these names become metric labels.
type Op string

const (
	// OpQuery is one read outside a transaction, until its first rows are
	// back (reading the rest is the caller's).
	OpQuery Op = "query"
	// OpExec is one statement outside a transaction.
	OpExec Op = "exec"
	// OpTransaction is one transaction, from BEGIN to its COMMIT or
	// ROLLBACK; on PostgreSQL each attempt of a retried write counts once.
	OpTransaction Op = "transaction"
	// OpWriteWait is a writer's wait for this process's write slot
	// (SQLite, which takes one writer at a time).
	OpWriteWait Op = "write_wait"
)

// Ops is every Op, for an Observer that sets up its series ahead.
var Ops = []Op{OpQuery, OpExec, OpTransaction, OpWriteWait}

// Observer is told how long each piece of store work took, whichever
// engine ran it. It must be cheap and must not call the store.
type Observer interface {
	ObserveStore(op Op, d time.Duration)
}

// Observe sends every later operation's duration to o (nil stops).
func (s *Store) Observe(o Observer) {
	if o == nil {
		s.db.obs.Store(nil)
		return
	}
	s.db.obs.Store(&o)
}

// observedDB is the pool with its statements outside transactions timed:
// every read and write of both engines passes through it or through
// txOnce, so one hook here covers them all.
type observedDB struct {
	*sql.DB
	obs atomic.Pointer[Observer]
}

func observe(db *sql.DB) *observedDB { return &observedDB{DB: db} }

// since reports op as taking from start until now, when anything observes.
func (d *observedDB) since(op Op, start time.Time) {
	if o := d.obs.Load(); o != nil {
		(*o).ObserveStore(op, time.Since(start))
	}
}

func (d *observedDB) QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error) {
	defer d.since(OpQuery, time.Now())
	return d.DB.QueryContext(ctx, query, args...)
}

func (d *observedDB) QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row {
	defer d.since(OpQuery, time.Now())
	return d.DB.QueryRowContext(ctx, query, args...)
}

func (d *observedDB) ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error) {
	defer d.since(OpExec, time.Now())
	return d.DB.ExecContext(ctx, query, args...)
}
