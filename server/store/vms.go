package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/a73x/eitri/wire/vmstate"
)

// VM is a virtual machine's durable row: what its owner wants (power, image,
// size) and the last status its host reported.
type VM struct {
	ID, OwnerID string
	HostID      string // "" while not placed
	Name        string
	ImageURL    string
	ImageSHA256 string
	VCPUs       int32
	MemMB       int64
	DiskGB      int64
	PowerState  string // desired: vmstate.PowerRunning or vmstate.PowerStopped
	// Last reported by the host, kept across disconnects and restarts;
	// Status is a vmstate phase, or vmstate.LifecycleLost once its host is
	// forgotten (see ForgetUnreachableHost).
	Status, LastError, AssignedIP string
	SSHAuthorizedKey              string
	SSHHostPubkey                 string
	CreatedAt, UpdatedAt          time.Time
	DeletedAt, DestroyAt          *time.Time // set by a soft delete
	// DesiredGen is the lineage generation at which the desired state (what
	// a snapshot sends about the VM) last changed. The store sets it on
	// every such write; what a caller puts here is ignored.
	DesiredGen uint64
	// Retry counts RetryVM calls; sent to the host, which starts a failed
	// VM over when it rises.
	Retry uint64
	// ExitsSeen is the host's count of unexpected guest exits already
	// recorded as events.
	ExitsSeen uint64
	// UserCAKeys are the SSH user CA keys (authorized_keys form) its
	// guest's seed trusts, as the control plane handed them; nil for a VM
	// created before they were recorded.
	UserCAKeys []string
	// ImageName and ImageVersion are the catalogue entry the VM was made
	// from ("" and 0 for a URL); Readiness is how its guest is judged ready
	// (an ImageReadiness word, "" for the host's default).
	ImageName    string
	ImageVersion int64
	Readiness    string
}

// VMEvent is one line of a VM's history.
type VMEvent struct {
	ID      int64 // assigned by the store
	VMID    string
	At      time.Time
	Kind    string
	Message string
}

func validVM(vm *VM) error {
	if vm.ID == "" || vm.OwnerID == "" || vm.Name == "" {
		return errors.New("store: vm needs an id, an owner and a name")
	}
	if vm.PowerState != vmstate.PowerRunning && vm.PowerState != vmstate.PowerStopped {
		return fmt.Errorf("store: invalid vm power state %q", vm.PowerState)
	}
	return nil
}

const vmCols = `id, owner_id, host_id, name, image_url, image_sha256, vcpus, mem_mb, disk_gb, power_state,
	status, last_error, assigned_ip, ssh_authorized_key, ssh_host_pubkey, created_at, updated_at, deleted_at, destroy_at, desired_gen,
	retry, exits_seen, user_ca_keys, image_name, image_version, readiness`

func vmArgs(vm *VM) []any {
	return []any{vm.ID, vm.OwnerID, nullString(vm.HostID), vm.Name, vm.ImageURL, vm.ImageSHA256, vm.VCPUs, vm.MemMB, vm.DiskGB, vm.PowerState,
		vm.Status, vm.LastError, vm.AssignedIP, vm.SSHAuthorizedKey, vm.SSHHostPubkey,
		nanos(vm.CreatedAt), nanos(vm.UpdatedAt), nullNanos(vm.DeletedAt), nullNanos(vm.DestroyAt), int64(vm.DesiredGen),
		int64(vm.Retry), int64(vm.ExitsSeen), strings.Join(vm.UserCAKeys, "\n"), vm.ImageName, vm.ImageVersion, vm.Readiness}
}

func scanVM(row interface{ Scan(...any) error }) (VM, error) {
	var vm VM
	var host sql.NullString
	var created, updated int64
	var deleted, destroy sql.NullInt64
	var gen, retry, exits int64
	var caKeys string
	err := row.Scan(&vm.ID, &vm.OwnerID, &host, &vm.Name, &vm.ImageURL, &vm.ImageSHA256, &vm.VCPUs, &vm.MemMB, &vm.DiskGB, &vm.PowerState,
		&vm.Status, &vm.LastError, &vm.AssignedIP, &vm.SSHAuthorizedKey, &vm.SSHHostPubkey, &created, &updated, &deleted, &destroy, &gen,
		&retry, &exits, &caKeys, &vm.ImageName, &vm.ImageVersion, &vm.Readiness)
	if err != nil {
		return VM{}, err
	}
	if caKeys != "" {
		vm.UserCAKeys = strings.Split(caKeys, "\n")
	}
	vm.DesiredGen = uint64(gen)
	vm.Retry, vm.ExitsSeen = uint64(retry), uint64(exits)
	vm.HostID = host.String
	vm.CreatedAt = fromNanos(created)
	vm.UpdatedAt = fromNanos(updated)
	vm.DeletedAt = fromNullNanos(deleted)
	vm.DestroyAt = fromNullNanos(destroy)
	return vm, nil
}

// nameTaken checks the per-owner name rule inside a write transaction, so
// the conflict can name the name (a bare constraint error cannot, portably).
func nameTaken(ctx context.Context, tx *sql.Tx, ownerID, name, exceptID string) error {
	var n int
	err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM vms WHERE owner_id = $1 AND name = $2 AND id <> $3`, ownerID, name, exceptID).Scan(&n)
	if err != nil {
		return err
	}
	if n > 0 {
		return fmt.Errorf("%w: a vm named %q already exists", ErrConflict, name)
	}
	return nil
}

// CreateVM inserts vm and returns the row as stored. Zero
// CreatedAt/UpdatedAt are set to now. A name the owner already uses
// (soft-deleted VMs included) is ErrConflict; an unknown owner or host is
// ErrNotFound.
func (s *Store) CreateVM(ctx context.Context, vm VM) (VM, error) {
	return s.CreateVMAdmitted(ctx, vm, nil)
}

// CreateVMAdmitted is CreateVM once admit has approved the VM in the same
// transaction: admit reads through r what the VM must fit (its owner's
// quota, its host's room), and what it read still holds when the VM is
// written, whatever other replicas write meanwhile. An error from admit is
// returned as is, with nothing written. admit may run more than once (see
// writePostgres). A nil admit approves.
func (s *Store) CreateVMAdmitted(ctx context.Context, vm VM, admit func(ctx context.Context, r Reader) error) (VM, error) {
	if err := validVM(&vm); err != nil {
		return VM{}, err
	}
	vm.CreatedAt = s.orNow(vm.CreatedAt)
	if vm.UpdatedAt.IsZero() {
		vm.UpdatedAt = vm.CreatedAt
	}
	var out VM
	err := s.write(ctx, func(tx *sql.Tx) error {
		if admit != nil {
			if err := admit(ctx, Reader{tx: tx}); err != nil {
				return err
			}
		}
		if err := nameTaken(ctx, tx, vm.OwnerID, vm.Name, vm.ID); err != nil {
			return err
		}
		l, err := nextGen(ctx, tx)
		if err != nil {
			return err
		}
		vm.DesiredGen = l.Generation
		_, err = tx.ExecContext(ctx, `INSERT INTO vms (`+vmCols+`)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20, $21, $22, $23, $24, $25, $26)`, vmArgs(&vm)...)
		switch {
		case isUniqueViolation(err):
			return fmt.Errorf("%w: vm %s (%q) already exists", ErrConflict, vm.ID, vm.Name)
		case isForeignKeyViolation(err):
			return fmt.Errorf("%w: vm %q names an unknown owner %s or host %s", ErrNotFound, vm.Name, vm.OwnerID, vm.HostID)
		case err != nil:
			return err
		}
		// Read back what is stored, as updateVM does, so the caller holds
		// exactly what a later GetVM returns (UTC, no monotonic clock).
		out, err = getVM(ctx, tx, vm.ID)
		return err
	})
	if err != nil {
		return VM{}, err
	}
	return out, nil
}

func getVM(ctx context.Context, q queryer, id string) (VM, error) {
	vm, err := scanVM(q.QueryRowContext(ctx, `SELECT `+vmCols+` FROM vms WHERE id = $1`, id))
	return vm, notFound(err, "vm "+id)
}

// GetVM returns the VM (soft-deleted ones too), or ErrNotFound.
func (s *Store) GetVM(ctx context.Context, id string) (VM, error) {
	return getVM(ctx, s.db, id)
}

// listVMs runs a VM query; where is a constant of this package, never input.
func (s *Store) listVMs(ctx context.Context, where string, args ...any) ([]VM, error) {
	return queryVMs(ctx, s.db, where, args...)
}

// queryVMs runs a VM query on q (the database or a transaction).
func queryVMs(ctx context.Context, q queryer, where string, args ...any) ([]VM, error) {
	rows, err := q.QueryContext(ctx, `SELECT `+vmCols+` FROM vms `+where+` ORDER BY created_at, id`, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []VM
	for rows.Next() {
		vm, err := scanVM(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, vm)
	}
	return out, rows.Err()
}

// ListVMs returns the owner's VMs (ownerID "" = everyone's), soft-deleted
// ones included, ordered by creation time then id.
func (s *Store) ListVMs(ctx context.Context, ownerID string) ([]VM, error) {
	if ownerID == "" {
		return s.listVMs(ctx, ``)
	}
	return s.listVMs(ctx, `WHERE owner_id = $1`, ownerID)
}

// ListVMsByHost returns the VMs placed on the host, soft-deleted ones
// included, ordered by creation time then id.
func (s *Store) ListVMsByHost(ctx context.Context, hostID string) ([]VM, error) {
	return s.listVMs(ctx, `WHERE host_id = $1`, hostID)
}

// UpdateVM is a read-modify-write of one VM in a single transaction: it
// loads the row, lets fn change it (an error from fn aborts with nothing
// written and is returned as is), and writes it back with UpdatedAt set to
// now. When fn changes nothing, nothing is written and changed is false.
// fn must not call the Store: the write lock is held while it runs.
// A change to the desired state advances DesiredGen.
func (s *Store) UpdateVM(ctx context.Context, id string, fn func(*VM) error) (VM, bool, error) {
	return s.updateVM(ctx, id, false, fn)
}

// ReassertVM is UpdateVM that advances DesiredGen even when fn changes
// nothing: the row is re-issued as newer than any version an agent holds
// (an admin adopting a VM the agent would not take the row's word on).
func (s *Store) ReassertVM(ctx context.Context, id string, fn func(*VM) error) (VM, error) {
	vm, _, err := s.updateVM(ctx, id, true, fn)
	return vm, err
}

func (s *Store) updateVM(ctx context.Context, id string, reassert bool, fn func(*VM) error) (VM, bool, error) {
	var out VM
	var changed bool
	err := s.write(ctx, func(tx *sql.Tx) error {
		before, err := getVM(ctx, tx, id)
		if err != nil {
			return err
		}
		after := before
		after.DeletedAt = clonePtr(before.DeletedAt)
		after.DestroyAt = clonePtr(before.DestroyAt)
		if err := fn(&after); err != nil {
			return err
		}
		if after.ID != before.ID {
			return fmt.Errorf("store: UpdateVM may not change the id (%s → %s)", before.ID, after.ID)
		}
		after.DesiredGen = before.DesiredGen
		if sameVM(before, after) && !reassert {
			out = before
			return nil
		}
		if reassert || !sameDesired(before, after) {
			l, err := nextGen(ctx, tx)
			if err != nil {
				return err
			}
			after.DesiredGen = l.Generation
		}
		if err := validVM(&after); err != nil {
			return err
		}
		if after.OwnerID != before.OwnerID || after.Name != before.Name {
			if err := nameTaken(ctx, tx, after.OwnerID, after.Name, after.ID); err != nil {
				return err
			}
		}
		after.UpdatedAt = s.now()
		// Keep updated_at moving forward even if the wall clock steps back.
		if !after.UpdatedAt.After(before.UpdatedAt) {
			after.UpdatedAt = before.UpdatedAt.Add(time.Nanosecond)
		}
		args := vmArgs(&after)
		_, err = tx.ExecContext(ctx, `UPDATE vms SET owner_id = $2, host_id = $3, name = $4, image_url = $5, image_sha256 = $6,
			vcpus = $7, mem_mb = $8, disk_gb = $9, power_state = $10, status = $11, last_error = $12, assigned_ip = $13,
			ssh_authorized_key = $14, ssh_host_pubkey = $15, created_at = $16, updated_at = $17, deleted_at = $18, destroy_at = $19,
			desired_gen = $20, retry = $21, exits_seen = $22, user_ca_keys = $23, image_name = $24, image_version = $25, readiness = $26
			WHERE id = $1`, args...)
		switch {
		case isUniqueViolation(err):
			return fmt.Errorf("%w: a vm named %q already exists", ErrConflict, after.Name)
		case isForeignKeyViolation(err):
			return fmt.Errorf("%w: vm %s names an unknown owner %s or host %s", ErrNotFound, id, after.OwnerID, after.HostID)
		case err != nil:
			return err
		}
		// Read back what is stored, so the caller sees exactly what a later
		// GetVM returns (UTC, no monotonic clock).
		out, err = getVM(ctx, tx, id)
		changed = true
		return err
	})
	if err != nil {
		return VM{}, false, err
	}
	return out, changed, nil
}

func clonePtr(t *time.Time) *time.Time {
	if t == nil {
		return nil
	}
	c := *t
	return &c
}

func sameTimePtr(a, b *time.Time) bool {
	if a == nil || b == nil {
		return a == b
	}
	return a.Equal(*b)
}

// sameVM compares everything fn may change, times by instant. UpdatedAt is
// left out: the store owns it.
func sameVM(a, b VM) bool {
	return a.ID == b.ID && a.OwnerID == b.OwnerID && a.HostID == b.HostID && a.Name == b.Name &&
		a.ImageURL == b.ImageURL && a.ImageSHA256 == b.ImageSHA256 &&
		a.VCPUs == b.VCPUs && a.MemMB == b.MemMB && a.DiskGB == b.DiskGB && a.PowerState == b.PowerState &&
		a.Status == b.Status && a.LastError == b.LastError && a.AssignedIP == b.AssignedIP &&
		a.SSHAuthorizedKey == b.SSHAuthorizedKey && a.SSHHostPubkey == b.SSHHostPubkey &&
		a.CreatedAt.Equal(b.CreatedAt) && sameTimePtr(a.DeletedAt, b.DeletedAt) && sameTimePtr(a.DestroyAt, b.DestroyAt) &&
		a.Retry == b.Retry && a.ExitsSeen == b.ExitsSeen
}

// sameDesired compares what a snapshot sends about the VM.
func sameDesired(a, b VM) bool {
	return a.OwnerID == b.OwnerID && a.HostID == b.HostID && a.Name == b.Name &&
		a.ImageURL == b.ImageURL && a.ImageSHA256 == b.ImageSHA256 &&
		a.VCPUs == b.VCPUs && a.MemMB == b.MemMB && a.DiskGB == b.DiskGB && a.PowerState == b.PowerState &&
		a.SSHAuthorizedKey == b.SSHAuthorizedKey && a.Retry == b.Retry &&
		sameTimePtr(a.DeletedAt, b.DeletedAt) && sameTimePtr(a.DestroyAt, b.DestroyAt)
}

// DeleteVM removes the VM row for good, with its exposures and events.
func (s *Store) DeleteVM(ctx context.Context, id string) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		// Explicit rather than relying only on ON DELETE CASCADE, so the
		// rows go even on a connection where foreign keys were left off.
		if _, err := tx.ExecContext(ctx, `DELETE FROM exposures WHERE vm_id = $1`, id); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM vm_events WHERE vm_id = $1`, id); err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, `DELETE FROM vms WHERE id = $1`, id)
		return mustAffect(res, err, "vm "+id)
	})
}

// MaxVMEvents is how many events a VM keeps: adding one past it drops the
// oldest, so no VM's timeline (nor a reply listing it) grows without bound.
const MaxVMEvents = 1000

// AddVMEvent appends an event to the VM's history, dropping the oldest
// past MaxVMEvents in the same transaction. A zero At is set to now; an
// unknown VM is ErrNotFound.
func (s *Store) AddVMEvent(ctx context.Context, e VMEvent) error {
	return s.addVMEvent(ctx, e, MaxVMEvents)
}

func (s *Store) addVMEvent(ctx context.Context, e VMEvent, keep int) error {
	if e.Kind == "" {
		return errors.New("store: vm event needs a kind")
	}
	at := s.orNow(e.At)
	return s.write(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO vm_events (vm_id, at, kind, message) VALUES ($1, $2, $3, $4)`,
			e.VMID, nanos(at), e.Kind, e.Message)
		if isForeignKeyViolation(err) {
			return fmt.Errorf("%w: vm %s", ErrNotFound, e.VMID)
		}
		if err != nil {
			return err
		}
		// The newest event past the ones kept, if any, and everything
		// older goes (in the order ListVMEvents reads). One statement: a
		// VM with no more than keep events has no such event, the
		// comparison is NULL and nothing goes.
		_, err = tx.ExecContext(ctx, `DELETE FROM vm_events WHERE vm_id = $1 AND (at, id) <= (
			SELECT at, id FROM vm_events WHERE vm_id = $1 ORDER BY at DESC, id DESC LIMIT 1 OFFSET $2)`, e.VMID, keep)
		return err
	})
}

// VMEventCursor is a place in a VM's timeline: the event a page starts at.
type VMEventCursor struct {
	At time.Time
	ID int64
}

// ListVMEventsBefore returns the newest n of the VM's events that come
// before the cursor (all of them for nil), oldest first.
func (s *Store) ListVMEventsBefore(ctx context.Context, vmID string, before *VMEventCursor, n int) ([]VMEvent, error) {
	at, id := int64(math.MaxInt64), int64(math.MaxInt64) // past every event
	if before != nil {
		at, id = nanos(before.At), before.ID
	}
	out, err := s.queryVMEvents(ctx, `SELECT id, vm_id, at, kind, message FROM vm_events WHERE vm_id = $1 AND (at, id) < ($2, $3)
		ORDER BY at DESC, id DESC LIMIT $4`, vmID, at, id, n)
	slices.Reverse(out)
	return out, err
}

// ListVMEvents returns the VM's events, oldest first.
func (s *Store) ListVMEvents(ctx context.Context, vmID string) ([]VMEvent, error) {
	return s.queryVMEvents(ctx, `SELECT id, vm_id, at, kind, message FROM vm_events WHERE vm_id = $1 ORDER BY at, id`, vmID)
}

func (s *Store) queryVMEvents(ctx context.Context, q string, args ...any) ([]VMEvent, error) {
	rows, err := s.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []VMEvent
	for rows.Next() {
		var e VMEvent
		var at int64
		if err := rows.Scan(&e.ID, &e.VMID, &at, &e.Kind, &e.Message); err != nil {
			return nil, err
		}
		e.At = fromNanos(at)
		out = append(out, e)
	}
	return out, rows.Err()
}
