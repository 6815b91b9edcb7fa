package store

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/a73x/eitri/wire/vmstate"
)

// HostLoss is what forgetting an unreachable host did to its rows.
type HostLoss struct {
	// Lost are the host's VMs as they are stored now: no host, status
	// vmstate.LifecycleLost.
	Lost []VM
	// Forgotten are its soft-deleted VMs, removed with their events.
	Forgotten []VM
	// Exposures are the host's exposures, all removed.
	Exposures []Exposure
}

// ForgetUnreachableHost removes a host that is gone for good, in one
// transaction: its live VMs are kept with no host, status
// vmstate.LifecycleLost (the row stays for its owner to read and delete; no
// host runs it) and the lastError it says; its soft-deleted VMs (whose
// destroy can never be confirmed) and every exposure on it are removed; then
// the host row goes.
// A host seen after seenBefore (it came back in the meantime) is
// ErrConflict and nothing is written.
func (s *Store) ForgetUnreachableHost(ctx context.Context, id string, seenBefore, at time.Time, lastError func(VM) string) (HostLoss, error) {
	var loss HostLoss
	err := s.write(ctx, func(tx *sql.Tx) error {
		loss = HostLoss{}
		h, err := scanHost(tx.QueryRowContext(ctx, `SELECT `+hostCols+` FROM hosts WHERE id = $1`, id))
		if err = notFound(err, "host "+id); err != nil {
			return err
		}
		seen := h.CreatedAt
		if h.LastSeenAt != nil {
			seen = *h.LastSeenAt
		}
		if seen.After(seenBefore) {
			return fmt.Errorf("%w: host %s was seen at %s", ErrConflict, id, seen.Format(time.RFC3339))
		}
		vms, err := queryVMs(ctx, tx, `WHERE host_id = $1`, id)
		if err != nil {
			return err
		}
		if loss.Exposures, err = queryExposures(ctx, tx, `WHERE host_id = $1`, id); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM exposures WHERE host_id = $1`, id); err != nil {
			return err
		}
		for _, v := range vms {
			if v.DeletedAt != nil {
				if _, err := tx.ExecContext(ctx, `DELETE FROM vm_events WHERE vm_id = $1`, v.ID); err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, `DELETE FROM vms WHERE id = $1`, v.ID); err != nil {
					return err
				}
				loss.Forgotten = append(loss.Forgotten, v)
				continue
			}
			updated := at
			if !updated.After(v.UpdatedAt) {
				updated = v.UpdatedAt.Add(time.Nanosecond)
			}
			if _, err := tx.ExecContext(ctx, `UPDATE vms SET host_id = NULL, status = $2, last_error = $3, updated_at = $4 WHERE id = $1`,
				v.ID, vmstate.LifecycleLost, lastError(v), nanos(updated)); err != nil {
				return err
			}
			lost, err := getVM(ctx, tx, v.ID)
			if err != nil {
				return err
			}
			loss.Lost = append(loss.Lost, lost)
		}
		res, err := tx.ExecContext(ctx, `DELETE FROM hosts WHERE id = $1`, id)
		return mustAffect(res, err, "host "+id)
	})
	if err != nil {
		return HostLoss{}, err
	}
	return loss, nil
}
