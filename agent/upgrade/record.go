package upgrade

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
)

// trial is a restart into a new build that has not yet proved itself: the
// guard watches it, the new build commits it once it reconnected. Kept in
// the upgrade dir so both processes (and a restarted agent) read it.
type trial struct {
	Target    string    `json:"target"`
	From      string    `json:"from"`
	RolloutID string    `json:"rollout_id"`
	Attempt   uint64    `json:"attempt"`
	SHA256    string    `json:"sha256"`
	Exe       string    `json:"exe"`
	Previous  string    `json:"previous"`
	PID       int       `json:"pid"`
	Started   time.Time `json:"started"`
	Deadline  time.Time `json:"deadline"`
	// Args, Env and Dir start the previous build again, the way the
	// agent was started, when nothing else will (no service manager).
	Args []string `json:"args"`
	Env  []string `json:"env"`
	Dir  string   `json:"dir"`
	// Committed is set by the new build once it reconnected and reported.
	Committed bool `json:"committed"`
}

// outcome is how the last upgrade ended, reported until the next offer.
type outcome struct {
	Target    string    `json:"target"`
	Step      string    `json:"step"`
	Detail    string    `json:"detail"`
	Error     string    `json:"error,omitempty"`
	RolloutID string    `json:"rollout_id"`
	Attempt   uint64    `json:"attempt"`
	SHA256    string    `json:"sha256"`
	At        time.Time `json:"at"`
}

const (
	trialFile   = "trial.json"
	outcomeFile = "outcome.json"
)

func readJSON(path string, v any) (bool, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return false, fmt.Errorf("%s: %w", path, err)
	}
	return true, nil
}

// writeJSON replaces path atomically: a reader sees the old record or the
// new, never half of one.
func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(filepath.Dir(path))
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
