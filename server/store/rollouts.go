package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"time"
)

// Rollout states. A rollout is active until it is done or aborted; a
// halted one waits for an admin (resume or abort).
const (
	RolloutCanary  = "canary"
	RolloutRolling = "rolling"
	RolloutPaused  = "paused"
	RolloutHalted  = "halted"
	RolloutDone    = "done"
	RolloutAborted = "aborted"
)

// RolloutActive reports a state in which the rollout still acts.
func RolloutActive(state string) bool { return state != RolloutDone && state != RolloutAborted }

// Rollout host states.
const (
	HostPending   = "pending"
	HostUpgrading = "upgrading"
	HostDone      = "done"
	HostFailed    = "failed"
	HostSkipped   = "skipped"
)

// Rollout is one fleet upgrade to a version.
type Rollout struct {
	ID, Version, State, Reason string
	MaxUnavailable             int
	AllowDowngrade             bool
	// Hosts in upgrade order; the first is the canary.
	Hosts     []RolloutHost
	CreatedBy string
	CreatedAt time.Time
	UpdatedAt time.Time
}

// RolloutHost is one host's part in a rollout.
type RolloutHost struct {
	HostID      string     `json:"host_id"`
	HostName    string     `json:"host_name"`
	State       string     `json:"state"`
	FromVersion string     `json:"from_version,omitempty"`
	Error       string     `json:"error,omitempty"`
	StartedAt   *time.Time `json:"started_at,omitempty"`
	FinishedAt  *time.Time `json:"finished_at,omitempty"`
	Attempt     uint64     `json:"attempt,omitempty"`
}

const rolloutCols = `id, version, state, reason, max_unavailable, allow_downgrade, hosts, created_by, created_at, updated_at`

func scanRollout(row interface{ Scan(...any) error }) (Rollout, error) {
	var r Rollout
	var hosts string
	var created, updated int64
	if err := row.Scan(&r.ID, &r.Version, &r.State, &r.Reason, &r.MaxUnavailable, &r.AllowDowngrade, &hosts, &r.CreatedBy, &created, &updated); err != nil {
		return Rollout{}, err
	}
	if err := json.Unmarshal([]byte(hosts), &r.Hosts); err != nil {
		return Rollout{}, fmt.Errorf("store: rollout %s hosts: %w", r.ID, err)
	}
	r.CreatedAt, r.UpdatedAt = fromNanos(created), fromNanos(updated)
	return r, nil
}

func hostsJSON(h []RolloutHost) string {
	if h == nil {
		h = []RolloutHost{}
	}
	b, _ := json.Marshal(h) // strings, numbers and times always marshal
	return string(b)
}

// CreateRollout inserts r. ErrConflict: another rollout is still active
// (one at a time, so two never offer a host different builds).
func (s *Store) CreateRollout(ctx context.Context, r Rollout) error {
	if r.ID == "" {
		return errors.New("store: a rollout needs an id")
	}
	r.CreatedAt = s.orNow(r.CreatedAt)
	return s.write(ctx, func(tx *sql.Tx) error {
		var id string
		err := tx.QueryRowContext(ctx, `SELECT id FROM rollouts WHERE state NOT IN ($1, $2) LIMIT 1`, RolloutDone, RolloutAborted).Scan(&id)
		switch {
		case err == nil:
			return fmt.Errorf("%w: rollout %s is still active; finish or abort it first", ErrConflict, id)
		case !errors.Is(err, sql.ErrNoRows):
			return err
		}
		_, err = tx.ExecContext(ctx, `INSERT INTO rollouts (`+rolloutCols+`) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)`,
			r.ID, r.Version, r.State, r.Reason, r.MaxUnavailable, r.AllowDowngrade, hostsJSON(r.Hosts), r.CreatedBy, nanos(r.CreatedAt), nanos(r.CreatedAt))
		if isUniqueViolation(err) {
			return fmt.Errorf("%w: rollout %s already exists", ErrConflict, r.ID)
		}
		return err
	})
}

// GetRollout returns one rollout, or ErrNotFound.
func (s *Store) GetRollout(ctx context.Context, id string) (Rollout, error) {
	r, err := scanRollout(s.db.QueryRowContext(ctx, `SELECT `+rolloutCols+` FROM rollouts WHERE id = $1`, id))
	return r, notFound(err, "rollout "+id)
}

// ListRollouts returns every rollout, newest first.
func (s *Store) ListRollouts(ctx context.Context) ([]Rollout, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+rolloutCols+` FROM rollouts ORDER BY created_at DESC, id DESC`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Rollout
	for rows.Next() {
		r, err := scanRollout(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// ActiveRollout returns the rollout still acting, if any.
func (s *Store) ActiveRollout(ctx context.Context) (Rollout, bool, error) {
	r, err := scanRollout(s.db.QueryRowContext(ctx, `SELECT `+rolloutCols+` FROM rollouts WHERE state NOT IN ($1, $2)
		ORDER BY created_at DESC LIMIT 1`, RolloutDone, RolloutAborted))
	if errors.Is(err, sql.ErrNoRows) {
		return Rollout{}, false, nil
	}
	return r, err == nil, err
}

// UpdateRollout applies fn to the rollout in one transaction and returns it
// as stored, and whether fn changed it. fn may run more than once
// (PostgreSQL retries), so it must compute only from the rollout it is
// given and what the caller read before.
func (s *Store) UpdateRollout(ctx context.Context, id string, fn func(*Rollout) error) (Rollout, bool, error) {
	var out Rollout
	var changed bool
	err := s.write(ctx, func(tx *sql.Tx) error {
		before, err := scanRollout(tx.QueryRowContext(ctx, `SELECT `+rolloutCols+` FROM rollouts WHERE id = $1`, id))
		if err != nil {
			return notFound(err, "rollout "+id)
		}
		after := before
		after.Hosts = append([]RolloutHost(nil), before.Hosts...)
		if err := fn(&after); err != nil {
			return err
		}
		after.ID, after.CreatedAt, after.CreatedBy = before.ID, before.CreatedAt, before.CreatedBy
		if reflect.DeepEqual(before, after) {
			out, changed = before, false
			return nil
		}
		after.UpdatedAt = s.now()
		_, err = tx.ExecContext(ctx, `UPDATE rollouts SET version = $1, state = $2, reason = $3, max_unavailable = $4, allow_downgrade = $5,
			hosts = $6, updated_at = $7 WHERE id = $8`,
			after.Version, after.State, after.Reason, after.MaxUnavailable, after.AllowDowngrade, hostsJSON(after.Hosts), nanos(after.UpdatedAt), id)
		if err != nil {
			return err
		}
		out, changed = after, true
		return nil
	})
	return out, changed, err
}
