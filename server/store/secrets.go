package store

import (
	"context"
	"database/sql"
	"fmt"
	"maps"
	"os"
	"slices"
)

// Secrets: what every replica must present alike — the TLS CA and serving
// identity that agents and clients pin, the SSH CAs guests trust — kept in
// the database on PostgreSQL, so a replica started anywhere, or rebuilt,
// holds the same. The control plane keeps using them as files in its data
// dir; these calls carry the files to and from the database. A SQLite
// control plane's files are the only copy.

// SecretFiles are the secrets replicas share, by their paths under a
// control plane's data dir (where pki and sshca keep them), with the modes
// they are written with. The one list: server/secrets.go carries them to
// and from the database, migrate-db copies them from a SQLite data dir.
var SecretFiles = map[string]os.FileMode{
	"tls/ca.crt": 0o644, "tls/ca.key": 0o600, "tls/server.crt": 0o644, "tls/server.key": 0o600,
	"ssh/user_ca": 0o600, "ssh/user_ca.pub": 0o644, "ssh/user_ca.previous.pub": 0o644,
	"ssh/host_ca": 0o600, "ssh/host_ca.pub": 0o644, "ssh/host_ca.previous.pub": 0o644,
}

// ChangeSecret is the change feed's kind for a secret written by another
// replica (a CA rotation).
const ChangeSecret = "secret"

// startupLock serializes replicas' first steps on one database (making the
// secrets, the first admin): "eitri" and a 4, as bytes.
const startupLock int64 = 0x65_69_74_72_69_00_04

// Secrets returns every secret by name.
func (s *Store) Secrets(ctx context.Context) (map[string][]byte, error) {
	out := map[string][]byte{}
	if !s.pg {
		return out, nil
	}
	rows, err := s.db.QueryContext(ctx, `SELECT name, data FROM secrets`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var name string
		var data []byte
		if err := rows.Scan(&name, &data); err != nil {
			return nil, err
		}
		out[name] = data
	}
	return out, rows.Err()
}

// PutSecrets writes secrets (new ones and replacements) in one transaction.
func (s *Store) PutSecrets(ctx context.Context, secrets map[string][]byte) error {
	if !s.pg || len(secrets) == 0 {
		return nil
	}
	return s.write(ctx, func(tx *sql.Tx) error { return putSecrets(ctx, tx, secrets) })
}

// putSecrets writes secrets in tx, by name; one that holds the same data
// already is left alone, so the change feed records only real changes.
func putSecrets(ctx context.Context, tx *sql.Tx, secrets map[string][]byte) error {
	for _, name := range slices.Sorted(maps.Keys(secrets)) {
		if _, err := tx.ExecContext(ctx, `INSERT INTO secrets (name, data) VALUES ($1, $2)
			ON CONFLICT (name) DO UPDATE SET data = EXCLUDED.data WHERE secrets.data <> EXCLUDED.data`, name, secrets[name]); err != nil {
			return fmt.Errorf("secret %s: %w", name, err)
		}
	}
	return nil
}

// Exclusive runs fn while no other replica on this database runs its own
// Exclusive: the first replica to start makes the secrets and the first
// admin, and the others find them made. On SQLite it just runs fn.
func (s *Store) Exclusive(ctx context.Context, fn func() error) error {
	if !s.pg {
		return fn()
	}
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, startupLock); err != nil {
		return fmt.Errorf("store: wait for other replicas starting: %w", err)
	}
	// The lock is the session's: released here, or when the connection
	// ends with a crash.
	defer conn.ExecContext(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock($1)`, startupLock) //nolint:errcheck
	return fn()
}
