package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
)

// Limits is a set of quota limits; nil is "not set here" (a user's limit
// then follows the default, a default the built-in value).
type Limits struct {
	VMs, VCPUs, MemMB, DiskGB, Exposures, Streams *int64
}

const limitCols = `vms, vcpus, mem_mb, disk_gb, exposures, streams`

func (l *Limits) fields() []**int64 {
	return []**int64{&l.VMs, &l.VCPUs, &l.MemMB, &l.DiskGB, &l.Exposures, &l.Streams}
}

func scanLimits(row *sql.Row) (Limits, error) {
	var l Limits
	ns := make([]sql.NullInt64, 6)
	if err := row.Scan(&ns[0], &ns[1], &ns[2], &ns[3], &ns[4], &ns[5]); err != nil {
		if errors.Is(err, sql.ErrNoRows) {
			return Limits{}, nil // nothing set is a row of NULLs
		}
		return Limits{}, err
	}
	for i, f := range l.fields() {
		if ns[i].Valid {
			v := ns[i].Int64
			*f = &v
		}
	}
	return l, nil
}

func (l *Limits) args() []any {
	out := make([]any, 0, 6)
	for _, f := range l.fields() {
		if *f == nil {
			out = append(out, sql.NullInt64{})
		} else {
			out = append(out, sql.NullInt64{Int64: **f, Valid: true})
		}
	}
	return out
}

// QuotaDefaults returns the fleet's default limits as set by an admin.
func (s *Store) QuotaDefaults(ctx context.Context) (Limits, error) {
	return scanLimits(s.db.QueryRowContext(ctx, selectQuotaDefaults))
}

const (
	selectQuotaDefaults = `SELECT ` + limitCols + ` FROM quota_defaults WHERE id = 1`
	selectUserQuota     = `SELECT ` + limitCols + ` FROM user_quotas WHERE user_id = $1`
)

// UserQuota returns the user's own limits.
func (s *Store) UserQuota(ctx context.Context, userID string) (Limits, error) {
	return scanLimits(s.db.QueryRowContext(ctx, selectUserQuota, userID))
}

// UpdateQuotaDefaults is a read-modify-write of the defaults in one
// transaction; it returns what is stored after fn.
func (s *Store) UpdateQuotaDefaults(ctx context.Context, fn func(*Limits)) (Limits, error) {
	var out Limits
	err := s.write(ctx, func(tx *sql.Tx) error {
		var err error
		out, err = scanLimits(tx.QueryRowContext(ctx, `SELECT `+limitCols+` FROM quota_defaults WHERE id = 1`))
		if err != nil {
			return err
		}
		fn(&out)
		// Portable "upsert": delete and insert inside the transaction.
		if _, err := tx.ExecContext(ctx, `DELETE FROM quota_defaults WHERE id = 1`); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `INSERT INTO quota_defaults (id, `+limitCols+`) VALUES (1, $1, $2, $3, $4, $5, $6)`, out.args()...)
		return err
	})
	return out, err
}

// UpdateUserQuota is a read-modify-write of the user's own limits in one
// transaction; it returns what is stored after fn. An unknown user is
// ErrNotFound.
func (s *Store) UpdateUserQuota(ctx context.Context, userID string, fn func(*Limits)) (Limits, error) {
	var out Limits
	err := s.write(ctx, func(tx *sql.Tx) error {
		var err error
		out, err = scanLimits(tx.QueryRowContext(ctx, `SELECT `+limitCols+` FROM user_quotas WHERE user_id = $1`, userID))
		if err != nil {
			return err
		}
		fn(&out)
		if _, err := tx.ExecContext(ctx, `DELETE FROM user_quotas WHERE user_id = $1`, userID); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `INSERT INTO user_quotas (user_id, `+limitCols+`) VALUES ($1, $2, $3, $4, $5, $6, $7)`,
			append([]any{userID}, out.args()...)...)
		if isForeignKeyViolation(err) {
			return fmt.Errorf("%w: user %s", ErrNotFound, userID)
		}
		return err
	})
	return out, err
}
