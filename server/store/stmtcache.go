package store

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"strings"
)

// SQLite's driver compiles every statement it is handed, and the store hands
// it the same few dozen statements over and over: compiling was a tenth of
// the control plane's CPU under a fleet's reports (issue 37). Each SQLite
// connection here therefore keeps the statements it has run compiled, for
// the next time the same text runs on it, inside a transaction or not.
// database/sql's own *sql.Stmt would do the same only for statements
// prepared ahead through the pool, which the store's transactions never
// see. PostgreSQL needs none of this: pgx caches statements itself.

// stmtsPerConn bounds what one connection keeps: the store's statements
// are constants, but a statement built with a variable number of
// placeholders has as many texts as lengths.
const stmtsPerConn = 256

// cachingConnector opens SQLite connections that keep their statements.
type cachingConnector struct {
	dsn string
	drv driver.Driver
}

// openSQLiteDB is sql.Open("sqlite", dsn) with connections that keep their
// statements compiled.
func openSQLiteDB(dsn string) (*sql.DB, error) {
	// The registered driver, as sql.Open would use it.
	probe, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, err
	}
	drv := probe.Driver()
	_ = probe.Close() // it never connected
	return sql.OpenDB(cachingConnector{dsn: dsn, drv: drv}), nil
}

func (c cachingConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.drv.Open(c.dsn)
	if err != nil {
		return nil, err
	}
	return newCachingConn(conn)
}

func (c cachingConnector) Driver() driver.Driver { return c.drv }

// sqliteConn is what the store needs of a driver connection; SQLite's
// has all of it.
type sqliteConn interface {
	driver.Conn
	driver.ConnBeginTx
	driver.ConnPrepareContext
	driver.ExecerContext
	driver.QueryerContext
	driver.Pinger
	driver.SessionResetter
	driver.Validator
}

type cachingConn struct {
	sqliteConn
	stmts map[string]*cachedStmt
}

// cachedStmt is a compiled statement; busy while rows read from it are
// open, when a second use of the same text compiles one of its own.
type cachedStmt struct {
	st   driver.Stmt
	busy bool
}

func newCachingConn(conn driver.Conn) (driver.Conn, error) {
	c, ok := conn.(sqliteConn)
	if !ok {
		conn.Close()
		return nil, errors.New("store: the SQLite driver's connection lacks an interface the store uses")
	}
	return &cachingConn{sqliteConn: c, stmts: map[string]*cachedStmt{}}, nil
}

// stmt returns query's statement on this connection, compiling it the first
// time; nil when it is not to be kept (a script of several statements,
// the cache full) or is in use.
func (c *cachingConn) stmt(ctx context.Context, query string) (*cachedStmt, error) {
	if cs, ok := c.stmts[query]; ok {
		if cs.busy {
			return nil, nil
		}
		return cs, nil
	}
	if len(c.stmts) >= stmtsPerConn || strings.Contains(strings.TrimRight(strings.TrimSpace(query), ";"), ";") {
		return nil, nil
	}
	st, err := c.sqliteConn.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	_, execs := st.(driver.StmtExecContext)
	_, queries := st.(driver.StmtQueryContext)
	if !execs || !queries {
		st.Close()
		return nil, nil
	}
	cs := &cachedStmt{st: st}
	c.stmts[query] = cs
	return cs, nil
}

func (c *cachingConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	cs, err := c.stmt(ctx, query)
	if err != nil {
		return nil, err
	}
	if cs == nil {
		return c.sqliteConn.ExecContext(ctx, query, args)
	}
	return cs.st.(driver.StmtExecContext).ExecContext(ctx, args)
}

func (c *cachingConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	cs, err := c.stmt(ctx, query)
	if err != nil {
		return nil, err
	}
	if cs == nil {
		return c.sqliteConn.QueryContext(ctx, query, args)
	}
	rows, err := cs.st.(driver.StmtQueryContext).QueryContext(ctx, args)
	if err != nil {
		return nil, err
	}
	cs.busy = true
	return &cachedRows{Rows: rows, cs: cs}, nil
}

// Close finalizes the kept statements, then closes the connection.
func (c *cachingConn) Close() error {
	var errs []error
	for q, cs := range c.stmts {
		errs = append(errs, cs.st.Close())
		delete(c.stmts, q)
	}
	errs = append(errs, c.sqliteConn.Close())
	return errors.Join(errs...)
}

// cachedRows frees its statement for the next use when closed (SQLite
// resets a kept statement then, instead of finalizing it).
type cachedRows struct {
	driver.Rows
	cs *cachedStmt
}

func (r *cachedRows) Close() error {
	err := r.Rows.Close()
	r.cs.busy = false
	return err
}
