package netsetup

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"time"
)

// ErrPoolExhausted means every address of the prefix is taken.
var ErrPoolExhausted = errors.New("netsetup: no free address left in the prefix")

// lease is one VM's reservation. AckedAt is set the first time the guest
// accepts the address (DHCPACK sent) and is kept across agent restarts:
// the address never changes for the VM, so the fact stays true.
//
// Owner is the VM's tenant key, kept here so the guest filter can be
// rebuilt from this table alone when the agent starts; an older file
// without it reads as "" (isolated) until the agent allocates again.
type lease struct {
	VMID    string     `json:"vm_id"`
	MAC     string     `json:"mac"`
	Addr    netip.Addr `json:"addr"`
	Owner   string     `json:"owner,omitempty"`
	AckedAt *time.Time `json:"acked_at,omitempty"`
	// PhonedAt is the guest's latest phone home (see phonehome.go), kept
	// like AckedAt so readiness survives an agent restart.
	PhonedAt *time.Time `json:"phoned_at,omitempty"`
	// phonedSaved is when PhonedAt was last written to the file.
	phonedSaved time.Time
}

type leaseFile struct {
	Version int      `json:"version"`
	Leases  []*lease `json:"leases"`
}

const leaseFileVersion = 1

// pool is the range of guest addresses: everything after the gateway up to
// the last address before broadcast.
type pool struct {
	prefix  netip.Prefix // masked
	gateway netip.Addr
	last    netip.Addr
}

func newPool(p netip.Prefix) (pool, error) {
	if !p.Addr().Is4() {
		return pool{}, fmt.Errorf("netsetup: prefix %s is not IPv4", p)
	}
	if p.Bits() < 8 || p.Bits() > 29 {
		return pool{}, fmt.Errorf("netsetup: prefix %s: length must be /8 to /29", p)
	}
	m := p.Masked()
	base := m.Addr().As4()
	bcast := binary.BigEndian.Uint32(base[:]) | (1<<(32-p.Bits()) - 1)
	var last [4]byte
	binary.BigEndian.PutUint32(last[:], bcast-1)
	return pool{prefix: m, gateway: m.Addr().Next(), last: netip.AddrFrom4(last)}, nil
}

func (p pool) contains(a netip.Addr) bool {
	return p.prefix.Contains(a) && a.Compare(p.gateway) > 0 && a.Compare(p.last) <= 0
}

func (p pool) mask() net.IPMask { return net.CIDRMask(p.prefix.Bits(), 32) }

// loadLeases reads the lease file. A missing file is an empty table; a file
// that cannot be parsed is an error, never "no leases": handing out
// addresses that running guests hold would be worse than not starting.
func loadLeases(path string) ([]*lease, error) {
	data, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("netsetup: read leases: %w", err)
	}
	var f leaseFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("netsetup: lease file %s is corrupt: %w", path, err)
	}
	if f.Version != leaseFileVersion {
		return nil, fmt.Errorf("netsetup: lease file %s has version %d, want %d", path, f.Version, leaseFileVersion)
	}
	return f.Leases, nil
}

// saveLeases writes the table atomically: a temp file in the same directory,
// synced, then renamed over the old one, then the directory synced.
func saveLeases(path string, leases []*lease) error {
	data, err := json.MarshalIndent(leaseFile{Version: leaseFileVersion, Leases: leases}, "", "  ")
	if err != nil {
		return err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("netsetup: lease dir: %w", err)
	}
	tmp, err := os.CreateTemp(dir, filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("netsetup: write leases: %w", err)
	}
	defer os.Remove(tmp.Name()) // no-op after a successful rename
	if _, err := tmp.Write(append(data, '\n')); err != nil {
		tmp.Close()
		return fmt.Errorf("netsetup: write leases: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("netsetup: write leases: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("netsetup: write leases: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("netsetup: write leases: %w", err)
	}
	if d, err := os.Open(dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}
