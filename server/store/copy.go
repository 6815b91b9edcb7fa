package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	sqlite3 "modernc.org/sqlite/lib"
)

// Moving a fleet from SQLite to PostgreSQL (eitri server migrate-db): Copy
// carries every durable row of a SQLite store into an empty PostgreSQL one
// in one transaction, ids and values as they are, so agents, tokens and
// VMs go on as if nothing moved. What each engine keeps for itself (the
// change feed, live state, calls in flight, the record of migrations) is
// not carried.

// copyTable is a table Copy carries, with every column it has.
type copyTable struct {
	name string
	cols []string
	// order puts the rows a row refers to before it (tokens: a session's
	// parent), and makes the copy's order fixed.
	order string
	// identity is a column PostgreSQL numbers itself; its sequence is set
	// past the highest id copied.
	identity string
}

// copyTables are the tables Copy carries, parents before children. A test
// holds this list (and each table's columns) to both engines' schemas, so
// a migration adding a table or a column fails it until Copy knows what to
// do with it.
var copyTables = []copyTable{
	{name: "users", cols: []string{"id", "name", "admin", "created_at"}, order: "id"},
	{name: "tokens", cols: []string{"id", "user_id", "name", "kind", "hash", "created_at", "expires_at", "last_used_at", "parent_id"},
		order: "(parent_id IS NOT NULL), created_at, id"},
	{name: "hosts", cols: []string{"id", "name", "credential_hash", "agent_version", "address", "accelerator", "accelerator_reason", "created_at", "last_seen_at",
		"os", "arch", "upgrade"}, order: "id"},
	{name: "join_tokens", cols: []string{"id", "hash", "created_by", "created_at", "expires_at", "used_at", "host_id"}, order: "id"},
	{name: "vms", cols: []string{"id", "owner_id", "host_id", "name", "image_url", "image_sha256", "vcpus", "mem_mb", "disk_gb",
		"power_state", "status", "last_error", "assigned_ip", "ssh_authorized_key", "ssh_host_pubkey",
		"created_at", "updated_at", "deleted_at", "destroy_at", "desired_gen", "retry", "exits_seen", "user_ca_keys",
		"image_name", "image_version", "readiness"}, order: "id"},
	{name: "exposures", cols: []string{"id", "vm_id", "host_id", "guest_port", "host_port", "protocol", "scope", "max_sessions", "created_at"},
		order: "id"},
	{name: "vm_events", cols: []string{"id", "vm_id", "at", "kind", "message"}, order: "id", identity: "id"},
	{name: "quota_defaults", cols: []string{"id", "vms", "vcpus", "mem_mb", "disk_gb", "exposures", "streams"}, order: "id"},
	{name: "user_quotas", cols: []string{"user_id", "vms", "vcpus", "mem_mb", "disk_gb", "exposures", "streams"}, order: "user_id"},
	// The lineage: its identity and counters are what agents hold the
	// control plane to, so the copy's replaces the one the target made
	// when it was opened.
	{name: "control_plane", cols: []string{"id", "identity", "epoch", "generation"}, order: "id"},
	// Empty on SQLite (its secrets are files); Copy's secrets argument
	// fills it.
	{name: "secrets", cols: []string{"name", "data"}, order: "name"},
	{name: "releases", cols: []string{"sha256", "version", "os", "arch", "size", "key_id", "signature", "data", "uploaded_by", "uploaded_at"},
		order: "sha256"},
	{name: "rollouts", cols: []string{"id", "version", "state", "reason", "max_unavailable", "allow_downgrade", "hosts", "created_by",
		"created_at", "updated_at"}, order: "id"},
	{name: "images", cols: []string{"name", "os", "os_version", "architecture", "login_user", "min_disk_gb", "min_mem_mb", "description",
		"readiness", "url", "sums_url", "sums_signature_url", "sums_file_name", "keyring", "current_version", "created_at", "updated_at"},
		order: "name"},
	{name: "image_versions", cols: []string{"name", "version", "url", "sha256", "sha512", "size", "sums_url", "sums_signature_url",
		"signer", "verified_at", "added_by", "created_at"}, order: "name, version"},
	{name: "image_pulls", cols: []string{"name", "host_id", "created_at"}, order: "name, host_id"},
}

// notCopied are the tables Copy leaves behind, and why.
var notCopied = map[string]string{
	"schema_migrations": "each database records its own migrations; both must be at this binary's version",
	"changes":           "the change feed replicas follow; a new fleet's starts empty",
	"host_live":         "live state, rebuilt from the agents when they reconnect",
	"calls":             "calls in flight between replicas",
}

// ErrTargetNotEmpty: the database Copy was to fill already holds a
// control plane's rows.
var ErrTargetNotEmpty = errors.New("the target database is not empty")

// ErrSourceInUse: another connection, in this process or another, has the
// database open (a control plane still running on it).
var ErrSourceInUse = errors.New("the database is in use")

// SourceSchemaError: the database to copy from is not at this binary's
// schema version, so the copy would misread it or leave columns out.
type SourceSchemaError struct {
	// At is the database's highest schema version; Want this binary's.
	At, Want int
}

func (e *SourceSchemaError) Error() string {
	switch {
	case e.At < e.Want:
		return fmt.Sprintf("its schema is at version %d and this eitri's at %d: start the old control plane once with this eitri (eitri server --data-dir …) so it migrates its database, stop it, then run migrate-db again", e.At, e.Want)
	case e.At > e.Want:
		return fmt.Sprintf("its schema is at version %d, newer than this eitri's %d: migrate with the eitri that last ran it", e.At, e.Want)
	}
	return fmt.Sprintf("its migrations are not this eitri's (both at version %d, but different ones)", e.At)
}

// sourceBusy is how long OpenSource waits for the database to be free.
const sourceBusy = 500 * time.Millisecond

// OpenSource opens the SQLite database at path to Copy from: as it is, with
// no migration and nothing written, and held exclusively until Close, so
// no control plane can write it (nor start on it) meanwhile. A database
// some other connection has open (a control plane still running) is
// refused with ErrSourceInUse, one at another schema version than this
// binary's with a *SourceSchemaError.
func OpenSource(ctx context.Context, path string) (*Store, error) {
	if path == "" || strings.ContainsAny(path, "?#") || path == ":memory:" {
		return nil, fmt.Errorf("store: invalid database path %q", path)
	}
	// Opening a missing file would create it.
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("store: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("store: %s is not a database file", path)
	}
	q := url.Values{}
	q.Add("_pragma", "busy_timeout("+strconv.FormatInt(sourceBusy.Milliseconds(), 10)+")")
	// Exclusive: the connection takes the whole file on its first
	// transaction and keeps it until closed. In WAL mode every other
	// connection holds a shared lock for as long as it is open, so the
	// first transaction below fails while anyone else has it open.
	q.Add("_pragma", "locking_mode(EXCLUSIVE)")
	q.Set("_txlock", "immediate")
	db, err := sql.Open("sqlite", path+"?"+q.Encode())
	if err != nil {
		return nil, fmt.Errorf("store: open %s: %w", path, err)
	}
	// One connection, kept: it is the one holding the lock.
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	s := &Store{db: observe(db), wlock: make(chan struct{}, 1), now: func() time.Time { return time.Now().UTC() }}
	if err := s.checkSource(ctx, path); err != nil {
		db.Close()
		return nil, err
	}
	return s, nil
}

func (s *Store) checkSource(ctx context.Context, path string) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		if sqliteCode(err)&0xff == sqlite3.SQLITE_BUSY {
			return fmt.Errorf("store: %s: %w: another process has it open (is its control plane still running? stop it first)", path, ErrSourceInUse)
		}
		return fmt.Errorf("store: open %s: %w", path, err)
	}
	defer tx.Rollback()
	var n int
	if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'`).Scan(&n); err != nil {
		return fmt.Errorf("store: read %s: %w", path, err)
	}
	if n == 0 {
		return fmt.Errorf("store: %s is not an eitri database (no schema_migrations table)", path)
	}
	if err := sameSchema(ctx, tx, sqliteMigrations); err != nil {
		return fmt.Errorf("store: %s: %w", path, err)
	}
	return nil
}

// sameSchema says whether the database q reads has applied exactly this
// binary's migrations (of the engine in dir), as a *SourceSchemaError if
// not.
func sameSchema(ctx context.Context, q queryer, dir string) error {
	ms, err := loadMigrations(dir)
	if err != nil {
		return err
	}
	want, wantMax := versions(ms)
	got, at, err := appliedVersions(ctx, q)
	if err != nil {
		return err
	}
	if !maps.Equal(got, want) {
		return &SourceSchemaError{At: at, Want: wantMax}
	}
	return nil
}

// Copied is how many rows a table holds after Copy.
type Copied struct {
	Table string
	Rows  int64
}

// copyBatchParams bounds the parameters of one multi-row INSERT
// (PostgreSQL takes at most 65,535).
const copyBatchParams = 30000

// Copy copies every durable row of the SQLite store from into the
// PostgreSQL store to, which must hold none (ErrTargetNotEmpty; nothing is
// written then), in one transaction: users, tokens and sessions, hosts,
// join tokens, VMs, exposures, VM events (with their ids), quotas, the
// lineage (identity, epoch and generation, which agents hold the control
// plane to), and secrets, the data dir's files that replicas share (see
// Secrets), by name. Both must be at this binary's schema version. Nothing
// may write from meanwhile: see OpenSource. It returns how many rows each
// table holds afterwards, in copy order.
//
// Replicas starting on to while the copy runs wait for it (they would
// otherwise make a first admin and secrets of their own).
func Copy(ctx context.Context, from, to *Store, secrets map[string][]byte) ([]Copied, error) {
	if from.pg {
		return nil, errors.New("store: copy: the source must be SQLite")
	}
	if !to.pg {
		return nil, errors.New("store: copy: the target must be PostgreSQL")
	}
	select {
	case from.wlock <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-from.wlock }()
	// A write transaction (BEGIN IMMEDIATE): one consistent view of the
	// source, and no writer beside it.
	src, err := from.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, fmt.Errorf("store: copy: read the source: %w", err)
	}
	defer src.Rollback()
	if err := sameSchema(ctx, src, sqliteMigrations); err != nil {
		return nil, fmt.Errorf("store: copy: the source: %w", err)
	}

	var out []Copied
	err = to.write(ctx, func(tx *sql.Tx) error {
		out = out[:0]
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, startupLock); err != nil {
			return err
		}
		if err := sameSchema(ctx, tx, postgresMigrations); err != nil {
			return fmt.Errorf("the target: %w", err)
		}
		if err := checkEmpty(ctx, tx); err != nil {
			return err
		}
		for _, t := range copyTables {
			if err := copyRows(ctx, src, tx, t); err != nil {
				return fmt.Errorf("%s: %w", t.name, err)
			}
		}
		if err := putSecrets(ctx, tx, secrets); err != nil {
			return err
		}
		for _, t := range copyTables {
			if t.identity == "" {
				continue
			}
			if _, err := tx.ExecContext(ctx, `SELECT setval(pg_get_serial_sequence($1, $2), coalesce(max(`+t.identity+`), 0) + 1, false) FROM `+t.name,
				t.name, t.identity); err != nil {
				return fmt.Errorf("%s: move its sequence past the copied ids: %w", t.name, err)
			}
		}
		// The triggers recorded the copy's inserts; no replica follows a
		// feed yet, and every one reads the database anew when it starts.
		if _, err := tx.ExecContext(ctx, `DELETE FROM changes`); err != nil {
			return err
		}
		for _, t := range copyTables {
			var n int64
			if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+t.name).Scan(&n); err != nil {
				return err
			}
			out = append(out, Copied{Table: t.name, Rows: n})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("store: copy: %w", err)
	}
	return out, nil
}

// checkEmpty refuses a target holding any row Copy would write, but for
// the lineage row every store makes when it is opened.
func checkEmpty(ctx context.Context, tx *sql.Tx) error {
	var held []string
	for _, t := range copyTables {
		if t.name == "control_plane" {
			continue
		}
		var n int64
		if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM `+t.name).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			held = append(held, fmt.Sprintf("%d in %s", n, t.name))
		}
	}
	if len(held) > 0 {
		return fmt.Errorf("%w: it holds rows (%s); copy only into a database no control plane has started on",
			ErrTargetNotEmpty, strings.Join(held, ", "))
	}
	return nil
}

// copyRows copies table t from src (SQLite) into dst (PostgreSQL), in
// multi-row inserts, converting each value to the target column's type.
func copyRows(ctx context.Context, src, dst *sql.Tx, t copyTable) error {
	types, err := pgColumnTypes(ctx, dst, t.name)
	if err != nil {
		return err
	}
	for _, c := range t.cols {
		if types[c] == "" {
			return fmt.Errorf("the target has no column %s", c)
		}
	}
	if t.name == "control_plane" {
		// The target made its own when it was opened.
		if _, err := dst.ExecContext(ctx, `DELETE FROM control_plane`); err != nil {
			return err
		}
	}
	cols := strings.Join(t.cols, ", ")
	rows, err := src.QueryContext(ctx, `SELECT `+cols+` FROM `+t.name+` ORDER BY `+t.order)
	if err != nil {
		return err
	}
	defer rows.Close()
	perBatch := max(1, min(500, copyBatchParams/len(t.cols)))
	batch := make([]any, 0, perBatch*len(t.cols))
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		var b strings.Builder
		b.WriteString(`INSERT INTO ` + t.name + ` (` + cols + `) VALUES `)
		for i := range len(batch) / len(t.cols) {
			if i > 0 {
				b.WriteString(", ")
			}
			b.WriteByte('(')
			for j := range t.cols {
				if j > 0 {
					b.WriteString(", ")
				}
				b.WriteString("$" + strconv.Itoa(i*len(t.cols)+j+1))
			}
			b.WriteByte(')')
		}
		_, err := dst.ExecContext(ctx, b.String(), batch...)
		batch = batch[:0]
		return err
	}
	vals := make([]any, len(t.cols))
	ptrs := make([]any, len(t.cols))
	for i := range vals {
		ptrs[i] = &vals[i]
	}
	for rows.Next() {
		clear(vals)
		if err := rows.Scan(ptrs...); err != nil {
			return err
		}
		for i, c := range t.cols {
			v, err := pgValue(vals[i], types[c])
			if err != nil {
				return fmt.Errorf("column %s: %w", c, err)
			}
			batch = append(batch, v)
		}
		if len(batch) == perBatch*len(t.cols) {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	return flush()
}

// pgColumnTypes returns the data type of each of the table's columns in
// PostgreSQL.
func pgColumnTypes(ctx context.Context, tx *sql.Tx, table string) (map[string]string, error) {
	rows, err := tx.QueryContext(ctx, `SELECT column_name, data_type FROM information_schema.columns
		WHERE table_schema = current_schema() AND table_name = $1`, table)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var name, typ string
		if err := rows.Scan(&name, &typ); err != nil {
			return nil, err
		}
		out[name] = typ
	}
	return out, rows.Err()
}

// pgValue converts v, as the SQLite driver reads it, to what a PostgreSQL
// column of type typ takes: SQLite keeps booleans as integers, and reads
// an empty BLOB as a nil slice (which would be a NULL).
func pgValue(v any, typ string) (any, error) {
	if v == nil {
		return nil, nil
	}
	switch typ {
	case "boolean":
		switch x := v.(type) {
		case bool:
			return x, nil
		case int64:
			if x == 0 || x == 1 {
				return x == 1, nil
			}
		}
	case "bigint", "integer", "smallint":
		switch x := v.(type) {
		case int64:
			return x, nil
		case bool:
			if x {
				return int64(1), nil
			}
			return int64(0), nil
		}
	case "text":
		switch x := v.(type) {
		case string:
			return x, nil
		case []byte:
			return string(x), nil
		}
	case "bytea":
		switch x := v.(type) {
		case []byte:
			if x == nil {
				x = []byte{}
			}
			return x, nil
		case string:
			return []byte(x), nil
		}
	}
	return nil, fmt.Errorf("cannot store a %T as %s", v, typ)
}
