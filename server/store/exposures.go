package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// Exposure publishes a guest port of a VM on a port of its host.
type Exposure struct {
	ID, VMID, HostID string
	GuestPort        uint16
	HostPort         uint16
	Protocol         string // "tcp" or "udp"
	Scope            string // "lan" or "local"
	MaxSessions      uint32 // 0 = no cap
	CreatedAt        time.Time
}

// PortHeldError is the conflict of a host port another exposure already
// holds. It matches ErrConflict with errors.Is.
type PortHeldError struct {
	ExposureID string // the holder
	HostID     string
	Protocol   string
	HostPort   uint16
}

func (e *PortHeldError) Error() string {
	return fmt.Sprintf("%v: host port %d/%s on host %s is held by exposure %s", ErrConflict, e.HostPort, e.Protocol, e.HostID, e.ExposureID)
}

func (e *PortHeldError) Unwrap() error { return ErrConflict }

func validExposure(e *Exposure) error {
	switch {
	case e.ID == "" || e.VMID == "" || e.HostID == "":
		return errors.New("store: exposure needs an id, a vm and a host")
	case e.Protocol != "tcp" && e.Protocol != "udp":
		return fmt.Errorf("store: invalid exposure protocol %q", e.Protocol)
	case e.Scope != "lan" && e.Scope != "local":
		return fmt.Errorf("store: invalid exposure scope %q", e.Scope)
	case e.GuestPort == 0 || e.HostPort == 0:
		return errors.New("store: exposure ports must be non-zero")
	}
	return nil
}

func portHolder(ctx context.Context, tx *sql.Tx, hostID, protocol string, port uint16) (string, error) {
	var id string
	err := tx.QueryRowContext(ctx, `SELECT id FROM exposures WHERE host_id = $1 AND protocol = $2 AND host_port = $3`,
		hostID, protocol, int64(port)).Scan(&id)
	if errors.Is(err, sql.ErrNoRows) {
		return "", nil
	}
	return id, err
}

// CreateExposure inserts e. A zero CreatedAt is set to now. A host port
// already held for the protocol on the host is a *PortHeldError naming the
// holder; an unknown VM or host is ErrNotFound.
func (s *Store) CreateExposure(ctx context.Context, e Exposure) error {
	if err := validExposure(&e); err != nil {
		return err
	}
	e.CreatedAt = s.orNow(e.CreatedAt)
	return s.write(ctx, func(tx *sql.Tx) error {
		held := func() error {
			holder, err := portHolder(ctx, tx, e.HostID, e.Protocol, e.HostPort)
			if err != nil {
				return err
			}
			if holder == "" {
				return nil
			}
			return &PortHeldError{ExposureID: holder, HostID: e.HostID, Protocol: e.Protocol, HostPort: e.HostPort}
		}
		if err := held(); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, `INSERT INTO exposures (id, vm_id, host_id, guest_port, host_port, protocol, scope, max_sessions, created_at)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
			e.ID, e.VMID, e.HostID, int64(e.GuestPort), int64(e.HostPort), e.Protocol, e.Scope, int64(e.MaxSessions), nanos(e.CreatedAt))
		switch {
		case isUniqueViolation(err):
			// Only the id can collide here: the port was checked under the
			// write lock.
			return fmt.Errorf("%w: exposure %s already exists", ErrConflict, e.ID)
		case isForeignKeyViolation(err):
			return fmt.Errorf("%w: exposure names an unknown vm %s or host %s", ErrNotFound, e.VMID, e.HostID)
		}
		return err
	})
}

const exposureCols = `id, vm_id, host_id, guest_port, host_port, protocol, scope, max_sessions, created_at`

func scanExposure(row interface{ Scan(...any) error }) (Exposure, error) {
	var e Exposure
	var guest, host, maxSessions, created int64
	if err := row.Scan(&e.ID, &e.VMID, &e.HostID, &guest, &host, &e.Protocol, &e.Scope, &maxSessions, &created); err != nil {
		return Exposure{}, err
	}
	e.GuestPort = uint16(guest)
	e.HostPort = uint16(host)
	e.MaxSessions = uint32(maxSessions)
	e.CreatedAt = fromNanos(created)
	return e, nil
}

// GetExposure returns the exposure, or ErrNotFound.
func (s *Store) GetExposure(ctx context.Context, id string) (Exposure, error) {
	e, err := scanExposure(s.db.QueryRowContext(ctx, `SELECT `+exposureCols+` FROM exposures WHERE id = $1`, id))
	return e, notFound(err, "exposure "+id)
}

// listExposures runs an exposure query; where is a constant of this
// package, never input.
func (s *Store) listExposures(ctx context.Context, where string, args ...any) ([]Exposure, error) {
	return queryExposures(ctx, s.db, where, args...)
}

// queryExposures runs an exposure query on q (the database or a transaction).
func queryExposures(ctx context.Context, q queryer, where string, args ...any) ([]Exposure, error) {
	rows, err := q.QueryContext(ctx, `SELECT `+exposureCols+` FROM exposures `+where+` ORDER BY created_at, id`, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Exposure
	for rows.Next() {
		e, err := scanExposure(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, e)
	}
	return out, rows.Err()
}

// ListExposures returns the VM's exposures (vmID "" = all), oldest first.
func (s *Store) ListExposures(ctx context.Context, vmID string) ([]Exposure, error) {
	if vmID == "" {
		return s.listExposures(ctx, ``)
	}
	return s.listExposures(ctx, `WHERE vm_id = $1`, vmID)
}

// ListExposuresByHost returns the exposures on the host, oldest first.
func (s *Store) ListExposuresByHost(ctx context.Context, hostID string) ([]Exposure, error) {
	return s.listExposures(ctx, `WHERE host_id = $1`, hostID)
}

// CountExposuresByOwner counts the exposures of the owner's VMs (deleted
// VMs' included: they come back with a restore).
func (s *Store) CountExposuresByOwner(ctx context.Context, ownerID string) (int64, error) {
	return countExposuresByOwner(ctx, s.db, ownerID)
}

func countExposuresByOwner(ctx context.Context, q queryer, ownerID string) (int64, error) {
	var n int64
	err := q.QueryRowContext(ctx, `SELECT COUNT(*) FROM exposures x JOIN vms v ON v.id = x.vm_id WHERE v.owner_id = $1`, ownerID).Scan(&n)
	return n, err
}

// UsedHostPorts returns the host ports taken for the protocol on the host.
func (s *Store) UsedHostPorts(ctx context.Context, hostID, protocol string) (map[uint16]bool, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT host_port FROM exposures WHERE host_id = $1 AND protocol = $2`, hostID, protocol)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	used := map[uint16]bool{}
	for rows.Next() {
		var p int64
		if err := rows.Scan(&p); err != nil {
			return nil, err
		}
		used[uint16(p)] = true
	}
	return used, rows.Err()
}

// DeleteExposure removes the exposure, or reports ErrNotFound.
func (s *Store) DeleteExposure(ctx context.Context, id string) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM exposures WHERE id = $1`, id)
		return mustAffect(res, err, "exposure "+id)
	})
}
