package store

import (
	"context"
	"crypto/rand"
	"database/sql"
	"errors"
	"fmt"
)

// Lineage is the control plane's durable identity and counters, which
// agents use to tell its word from a stale one (see
// eitri.v1.DesiredStateSnapshot).
type Lineage struct {
	// ID is made once, on the first start, and never changes.
	ID string
	// Epoch rises each time the control plane finds it lost writes.
	Epoch uint64
	// Generation is the last value handed out by the counter.
	Generation uint64
}

// ensureLineage makes the lineage row on a store that has none. The counter
// starts at the wall clock in nanoseconds: that is what generations used to
// be, so an agent still remembering one accepts the first counted snapshot.
func (s *Store) ensureLineage(ctx context.Context) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		var n int
		if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM control_plane`).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			return nil
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO control_plane (id, identity, epoch, generation) VALUES (1, $1, 1, $2)`,
			"cp_"+rand.Text(), nanos(s.now()))
		return err
	})
}

func getLineage(ctx context.Context, q queryer) (Lineage, error) {
	var l Lineage
	var epoch, gen int64
	err := q.QueryRowContext(ctx, `SELECT identity, epoch, generation FROM control_plane WHERE id = 1`).Scan(&l.ID, &epoch, &gen)
	if errors.Is(err, sql.ErrNoRows) {
		return l, errors.New("store: no control plane lineage row")
	}
	l.Epoch, l.Generation = uint64(epoch), uint64(gen)
	return l, err
}

// Lineage returns the identity and counters as stored.
func (s *Store) Lineage(ctx context.Context) (Lineage, error) {
	return getLineage(ctx, s.db)
}

// nextGen advances the counter inside tx and returns the new value with the
// lineage it belongs to.
func nextGen(ctx context.Context, tx *sql.Tx) (Lineage, error) {
	l, err := getLineage(ctx, tx)
	if err != nil {
		return l, err
	}
	l.Generation++
	_, err = tx.ExecContext(ctx, `UPDATE control_plane SET generation = $1 WHERE id = 1`, int64(l.Generation))
	return l, err
}

// NextGeneration durably advances the counter and returns it: every
// snapshot gets a generation no earlier snapshot had, whatever the clock
// does.
func (s *Store) NextGeneration(ctx context.Context) (Lineage, error) {
	var l Lineage
	err := s.write(ctx, func(tx *sql.Tx) error {
		var err error
		l, err = nextGen(ctx, tx)
		return err
	})
	return l, err
}

// FenceForward is told the lineage an agent has applied. An agent ahead of
// the store (a later epoch, or a generation the counter never reached) saw
// writes this store no longer has: it was restored from an older copy, or
// lost its last commits. The store then starts a new epoch and moves the
// counter past what the agent applied, so everything written from here on
// is newer than anything any agent saw; bumped says it did.
func (s *Store) FenceForward(ctx context.Context, epoch, gen uint64) (l Lineage, bumped bool, err error) {
	err = s.write(ctx, func(tx *sql.Tx) error {
		var err error
		if l, err = getLineage(ctx, tx); err != nil {
			return err
		}
		if epoch <= l.Epoch && gen <= l.Generation {
			return nil
		}
		l.Epoch = max(l.Epoch, epoch) + 1
		l.Generation = max(l.Generation, gen)
		_, err = tx.ExecContext(ctx, `UPDATE control_plane SET epoch = $1, generation = $2 WHERE id = 1`, int64(l.Epoch), int64(l.Generation))
		bumped = err == nil
		return err
	})
	if err != nil {
		return Lineage{}, false, fmt.Errorf("store: fence forward: %w", err)
	}
	return l, bumped, nil
}
