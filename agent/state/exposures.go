package state

import (
	"errors"
	"fmt"
	"path/filepath"
)

const exposuresFile = "exposures.json"

// Exposure is the agent's own copy of one published port, so a restarted
// agent serves it again before the control plane answers (or while it is
// down).
type Exposure struct {
	ID   string
	VMID string
	// Protocol is "tcp" or "udp".
	Protocol string
	// Scope is "lan" (every host address) or "local" (loopback only).
	Scope       string
	HostPort    uint16
	GuestPort   uint16
	MaxSessions uint32 `json:",omitempty"`
}

// exposureSet is the file's shape: one object, so fields can be added
// beside the list later.
type exposureSet struct {
	Exposures []Exposure
}

// SaveExposures durably replaces the whole set of published ports: the
// desired state is complete, so its latest list is the truth.
func (s *Store) SaveExposures(list []Exposure) error {
	for _, e := range list {
		if err := e.check(); err != nil {
			return err
		}
	}
	if list == nil {
		list = []Exposure{}
	}
	return writeJSON(s.dir, exposuresFile, exposureSet{Exposures: list})
}

// LoadExposures returns the last saved set. ok is false only when none was
// ever saved; a file that cannot be read, or holds an exposure that could
// not have been saved, is an error.
func (s *Store) LoadExposures() (list []Exposure, ok bool, err error) {
	var set exposureSet
	ok, err = readJSON(filepath.Join(s.dir, exposuresFile), &set)
	if err != nil || !ok {
		return nil, ok, err
	}
	for _, e := range set.Exposures {
		if err := e.check(); err != nil {
			return nil, false, fmt.Errorf("state: corrupt record %s: %w", exposuresFile, err)
		}
	}
	return set.Exposures, true, nil
}

func (e Exposure) check() error {
	switch {
	case e.ID == "":
		return errors.New("state: exposure without an id")
	case !ValidID(e.VMID):
		return fmt.Errorf("state: exposure %s: invalid vm id %q", e.ID, e.VMID)
	case e.Protocol != "tcp" && e.Protocol != "udp":
		return fmt.Errorf("state: exposure %s: protocol %q", e.ID, e.Protocol)
	case e.Scope != "lan" && e.Scope != "local":
		return fmt.Errorf("state: exposure %s: scope %q", e.ID, e.Scope)
	case e.HostPort == 0 || e.GuestPort == 0:
		return fmt.Errorf("state: exposure %s: port 0", e.ID)
	}
	return nil
}
