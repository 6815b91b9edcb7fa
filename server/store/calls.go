package store

import (
	"context"
	"database/sql"
	"errors"
)

// Calls crossing replicas (PostgreSQL only): a console or tunnel request
// lands on any replica, but only the replica holding the host's Calls
// stream can send the call down it. The requesting replica posts the call
// here and waits for the agent's answer stream, which the call tells the
// agent to open at the requesting replica; the holder takes the row and
// sends the call on. Nothing but the call crosses the database.

// CallsChannel is the NOTIFY channel posted calls wake the holders on.
const CallsChannel = "eitri_calls"

// PostedCall is one call waiting for the replica holding its host.
type PostedCall struct {
	ID, HostID string
	// Call is the wire message (CallsResponse), marshalled.
	Call []byte
}

// PostCall queues a call for the host's holder and wakes it.
func (s *Store) PostCall(ctx context.Context, c PostedCall) error {
	if !s.pg {
		return errors.New("store: calls cross replicas only on PostgreSQL")
	}
	// Read committed (see writeCommitted): an insert checks nothing.
	return s.writeCommitted(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, `INSERT INTO calls (id, host_id, call, at) VALUES ($1, $2, $3, `+dbNow+`)`,
			c.ID, c.HostID, c.Call); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `SELECT pg_notify($1, '')`, CallsChannel)
		return err
	})
}

// TakeCalls removes and returns the calls waiting for any of hosts. One
// statement, so no transaction of its own: a call is deleted, and so
// returned, once.
func (s *Store) TakeCalls(ctx context.Context, hosts []string) ([]PostedCall, error) {
	if !s.pg || len(hosts) == 0 {
		return nil, nil
	}
	rows, err := s.db.QueryContext(ctx, `DELETE FROM calls WHERE host_id = ANY($1) RETURNING id, host_id, call`, hosts)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []PostedCall
	for rows.Next() {
		var c PostedCall
		if err := rows.Scan(&c.ID, &c.HostID, &c.Call); err != nil {
			return nil, err
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// DropCall forgets a call nobody took (its caller gave up).
func (s *Store) DropCall(ctx context.Context, id string) error {
	if !s.pg {
		return nil
	}
	_, err := s.db.ExecContext(ctx, `DELETE FROM calls WHERE id = $1`, id)
	return err
}
