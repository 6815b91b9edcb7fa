package state

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"
)

const (
	lineageFile  = "lineage.json"
	destroyedDir = "destroyed" // <id>.json per VM this host destroyed
)

// Lineage is the control plane this agent takes desired state from and the
// newest snapshot it applied (eitri.v1.DesiredStateSnapshot): a snapshot
// from another control plane, or older than this, is refused.
type Lineage struct {
	// ControlPlaneID is pinned by the first snapshot that carries one.
	ControlPlaneID string `json:",omitempty"`
	Epoch          uint64 `json:",omitempty"`
	Generation     uint64 `json:",omitempty"`
}

// LoadLineage returns the saved lineage; ok is false when none was saved.
func (s *Store) LoadLineage() (Lineage, bool, error) {
	var l Lineage
	ok, err := readJSON(filepath.Join(s.dir, lineageFile), &l)
	return l, ok, err
}

// SaveLineage durably replaces the lineage.
func (s *Store) SaveLineage(l Lineage) error {
	return writeJSON(s.dir, lineageFile, l)
}

type destroyedMark struct {
	At time.Time
}

// MarkDestroyed durably remembers that this host destroyed the VM at at, so
// a desired state that names it again (a restore that raced the destroy, a
// control plane restored from an older copy) is answered with "destroyed",
// never with a fresh, empty VM of the same id. Marks are never removed.
func (s *Store) MarkDestroyed(id string, at time.Time) error {
	if err := checkID(id); err != nil {
		return err
	}
	dir := filepath.Join(s.dir, destroyedDir)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("state: %w", err)
	}
	return writeJSON(dir, id+recordSuffix, destroyedMark{At: at.UTC()})
}

// Destroyed returns every VM this host destroyed, with when. A mark that
// exists but cannot be read still counts, at the zero time: better "when
// unknown" than a VM built again on a destroyed id.
func (s *Store) Destroyed() (map[string]time.Time, error) {
	dir := filepath.Join(s.dir, destroyedDir)
	ents, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return map[string]time.Time{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("state: list destroyed vms: %w", err)
	}
	out := make(map[string]time.Time, len(ents))
	for _, e := range ents {
		name := e.Name()
		if e.IsDir() || strings.HasPrefix(name, tmpPrefix) || !strings.HasSuffix(name, recordSuffix) {
			continue
		}
		id := strings.TrimSuffix(name, recordSuffix)
		var m destroyedMark
		_, _ = readJSON(filepath.Join(dir, name), &m)
		out[id] = m.At
	}
	return out, nil
}
