package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Host is an enrolled machine running the agent.
type Host struct {
	ID, Name       string
	CredentialHash []byte // sha256 of the host credential; unique
	AgentVersion   string
	Address        string
	Accelerator    string
	// AcceleratorReason is the agent's one sentence on why.
	AcceleratorReason string
	CreatedAt         time.Time
	LastSeenAt        *time.Time
	// OS and Arch are the agent's platform, as its last hello said.
	OS, Arch string
	// Upgrade is the agent's own word on its last upgrade; zero when it
	// never had one.
	Upgrade HostUpgrade
}

// HostUpgrade is what an agent last said about an upgrade it was offered:
// the steps that change what the rollout does (not its progress).
type HostUpgrade struct {
	Target    string    `json:"target"`
	Step      string    `json:"step"`
	Error     string    `json:"error,omitempty"`
	RolloutID string    `json:"rollout_id,omitempty"`
	Attempt   uint64    `json:"attempt,omitempty"`
	Since     time.Time `json:"since"`
}

// JoinToken buys one host enrollment before ExpiresAt.
type JoinToken struct {
	ID        string
	Hash      []byte // sha256 of the secret; unique
	CreatedBy string // user id
	CreatedAt time.Time
	ExpiresAt time.Time
	UsedAt    *time.Time
	HostID    string // the host it enrolled, once used ("" if that host is gone)
}

const hostCols = `id, name, credential_hash, agent_version, address, accelerator, accelerator_reason, created_at, last_seen_at, os, arch, upgrade`

func scanHost(row interface{ Scan(...any) error }) (Host, error) {
	var h Host
	var created int64
	var seen sql.NullInt64
	var upgrade string
	if err := row.Scan(&h.ID, &h.Name, &h.CredentialHash, &h.AgentVersion, &h.Address, &h.Accelerator, &h.AcceleratorReason, &created, &seen,
		&h.OS, &h.Arch, &upgrade); err != nil {
		return Host{}, err
	}
	h.CreatedAt = fromNanos(created)
	h.LastSeenAt = fromNullNanos(seen)
	if upgrade != "" {
		if err := json.Unmarshal([]byte(upgrade), &h.Upgrade); err != nil {
			return Host{}, fmt.Errorf("store: host %s upgrade: %w", h.ID, err)
		}
	}
	return h, nil
}

func upgradeJSON(u HostUpgrade) string {
	if u == (HostUpgrade{}) {
		return ""
	}
	b, _ := json.Marshal(u) // strings, a number and a time always marshal
	return string(b)
}

func insertHost(ctx context.Context, tx *sql.Tx, h Host) error {
	if h.ID == "" || len(h.CredentialHash) == 0 {
		return errors.New("store: host needs an id and a credential hash")
	}
	_, err := tx.ExecContext(ctx, `INSERT INTO hosts (`+hostCols+`) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)`,
		h.ID, h.Name, h.CredentialHash, h.AgentVersion, h.Address, h.Accelerator, h.AcceleratorReason, nanos(h.CreatedAt), nullNanos(h.LastSeenAt),
		h.OS, h.Arch, upgradeJSON(h.Upgrade))
	if isUniqueViolation(err) {
		return fmt.Errorf("%w: host %s or its credential already exists", ErrConflict, h.ID)
	}
	return err
}

// CreateHost inserts a host directly, without a join token (for wiring that
// enrolls its own agent, and for tests). A zero CreatedAt is set to now.
func (s *Store) CreateHost(ctx context.Context, h Host) error {
	h.CreatedAt = s.orNow(h.CreatedAt)
	return s.write(ctx, func(tx *sql.Tx) error { return insertHost(ctx, tx, h) })
}

// HostByID returns the host, or ErrNotFound.
func (s *Store) HostByID(ctx context.Context, id string) (Host, error) {
	h, err := scanHost(s.db.QueryRowContext(ctx, `SELECT `+hostCols+` FROM hosts WHERE id = $1`, id))
	return h, notFound(err, "host "+id)
}

// HostByCredentialHash returns the host holding this credential, or
// ErrNotFound.
func (s *Store) HostByCredentialHash(ctx context.Context, hash []byte) (Host, error) {
	h, err := scanHost(s.db.QueryRowContext(ctx, `SELECT `+hostCols+` FROM hosts WHERE credential_hash = $1`, hash))
	return h, notFound(err, "host credential")
}

// ListHosts returns every host ordered by name (then id).
func (s *Store) ListHosts(ctx context.Context) ([]Host, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+hostCols+` FROM hosts ORDER BY name, id`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Host
	for rows.Next() {
		h, err := scanHost(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, h)
	}
	return out, rows.Err()
}

// HostHello is what an agent says about itself on connecting.
type HostHello struct {
	AgentVersion, Address, Accelerator, AcceleratorReason string
	OS, Arch                                              string
}

// UpdateHostHello records what the agent said about itself on connecting;
// hearing from it also counts as seeing it.
func (s *Store) UpdateHostHello(ctx context.Context, id string, h HostHello, at time.Time) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `UPDATE hosts SET agent_version = $1, address = $2, accelerator = $3, accelerator_reason = $4, last_seen_at = $5,
			os = $6, arch = $7 WHERE id = $8`,
			h.AgentVersion, h.Address, h.Accelerator, h.AcceleratorReason, nanos(at), h.OS, h.Arch, id)
		return mustAffect(res, err, "host "+id)
	})
}

// SetHostUpgrade records the agent's word on its upgrade.
func (s *Store) SetHostUpgrade(ctx context.Context, id string, u HostUpgrade) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `UPDATE hosts SET upgrade = $1 WHERE id = $2`, upgradeJSON(u), id)
		return mustAffect(res, err, "host "+id)
	})
}

// UpdateHostAccelerator records a change of accelerator an agent reported
// mid-stream (a re-probe).
func (s *Store) UpdateHostAccelerator(ctx context.Context, id, accelerator, reason string) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `UPDATE hosts SET accelerator = $1, accelerator_reason = $2 WHERE id = $3`, accelerator, reason, id)
		return mustAffect(res, err, "host "+id)
	})
}

// TouchHost records that the host was seen at `at`.
func (s *Store) TouchHost(ctx context.Context, id string, at time.Time) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `UPDATE hosts SET last_seen_at = $1 WHERE id = $2`, nanos(at), id)
		return mustAffect(res, err, "host "+id)
	})
}

// DeleteHost removes the host. It is refused with ErrConflict while any VM
// row (soft-deleted ones included) or exposure still names the host: those
// must be destroyed first, or the fleet would forget machines it runs.
func (s *Store) DeleteHost(ctx context.Context, id string) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		var vms, exps int
		if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM vms WHERE host_id = $1`, id).Scan(&vms); err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM exposures WHERE host_id = $1`, id).Scan(&exps); err != nil {
			return err
		}
		if vms > 0 || exps > 0 {
			return fmt.Errorf("%w: host %s still has %d vm(s) and %d exposure(s)", ErrConflict, id, vms, exps)
		}
		res, err := tx.ExecContext(ctx, `DELETE FROM hosts WHERE id = $1`, id)
		return mustAffect(res, err, "host "+id)
	})
}

// CreateJoinToken inserts jt. A zero CreatedAt is set to now; ExpiresAt is
// required.
func (s *Store) CreateJoinToken(ctx context.Context, jt JoinToken) error {
	if jt.ID == "" || len(jt.Hash) == 0 || jt.ExpiresAt.IsZero() {
		return errors.New("store: join token needs an id, a hash and an expiry")
	}
	return s.write(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO join_tokens (id, hash, created_by, created_at, expires_at, used_at, host_id)
			VALUES ($1, $2, $3, $4, $5, $6, $7)`,
			jt.ID, jt.Hash, jt.CreatedBy, nanos(s.orNow(jt.CreatedAt)), nanos(jt.ExpiresAt), nullNanos(jt.UsedAt), nullString(jt.HostID))
		switch {
		case isUniqueViolation(err):
			return fmt.Errorf("%w: join token %s already exists", ErrConflict, jt.ID)
		case isForeignKeyViolation(err):
			return fmt.Errorf("%w: host %s", ErrNotFound, jt.HostID)
		}
		return err
	})
}

// ConsumeJoinToken spends the join token with this hash on enrolling h, in
// one transaction: the token must exist (ErrNotFound), be unused
// (ErrJoinTokenUsed) and not be expired at now (ErrJoinTokenExpired, also
// when now is exactly ExpiresAt). On success the token is marked used by h
// and h is inserted (a zero h.CreatedAt becomes now). On any error nothing
// is written.
func (s *Store) ConsumeJoinToken(ctx context.Context, hash []byte, now time.Time, h Host) error {
	if h.CreatedAt.IsZero() {
		h.CreatedAt = now
	}
	return s.write(ctx, func(tx *sql.Tx) error {
		var id string
		var expires int64
		var used sql.NullInt64
		err := tx.QueryRowContext(ctx, `SELECT id, expires_at, used_at FROM join_tokens WHERE hash = $1`, hash).Scan(&id, &expires, &used)
		if err != nil {
			return notFound(err, "join token")
		}
		if used.Valid {
			return ErrJoinTokenUsed
		}
		if !now.Before(fromNanos(expires)) {
			return ErrJoinTokenExpired
		}
		if err := insertHost(ctx, tx, h); err != nil {
			return err
		}
		// The used_at guard keeps the spend single-use even where the
		// transactions of concurrent callers interleave (PostgreSQL under
		// READ COMMITTED); here the write lock already serializes them.
		res, err := tx.ExecContext(ctx, `UPDATE join_tokens SET used_at = $1, host_id = $2 WHERE id = $3 AND used_at IS NULL`,
			nanos(now), h.ID, id)
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil {
			return err
		} else if n != 1 {
			return ErrJoinTokenUsed
		}
		return nil
	})
}

// JoinTokenByHash returns the join token with this hash, or ErrNotFound.
func (s *Store) JoinTokenByHash(ctx context.Context, hash []byte) (JoinToken, error) {
	var jt JoinToken
	var created, expires int64
	var used sql.NullInt64
	var host sql.NullString
	err := s.db.QueryRowContext(ctx, `SELECT id, hash, created_by, created_at, expires_at, used_at, host_id FROM join_tokens WHERE hash = $1`, hash).
		Scan(&jt.ID, &jt.Hash, &jt.CreatedBy, &created, &expires, &used, &host)
	if err != nil {
		return JoinToken{}, notFound(err, "join token")
	}
	jt.CreatedAt = fromNanos(created)
	jt.ExpiresAt = fromNanos(expires)
	jt.UsedAt = fromNullNanos(used)
	jt.HostID = host.String
	return jt, nil
}
