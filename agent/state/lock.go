package state

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// lockFileName sits at the top of an agent's data dir.
const lockFileName = "agent.lock"

// ErrLocked is wrapped by LockDir's error when another process holds the dir.
var ErrLocked = errors.New("data dir is in use")

// DirLock is an exclusive hold on a data dir for the life of a process.
type DirLock struct{ f *os.File }

// LockDir takes an exclusive flock on dir/agent.lock, so two agents never
// run on one data dir and fight over the same QEMUs. The kernel drops the
// lock when the process dies however it dies, so a stale file never blocks a
// restart. The holder's pid is written into the file so the refusal can name
// it.
func LockDir(dir string) (*DirLock, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("state: data dir: %w", err)
	}
	path := filepath.Join(dir, lockFileName)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("state: lock file: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		defer f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			holder := "another process"
			if b, rerr := os.ReadFile(path); rerr == nil {
				if pid, perr := strconv.Atoi(strings.TrimSpace(string(b))); perr == nil && pid > 0 {
					holder = fmt.Sprintf("pid %d", pid)
				}
			}
			return nil, fmt.Errorf("%w: another eitri agent is already running on %s (%s); one agent per data dir", ErrLocked, dir, holder)
		}
		return nil, fmt.Errorf("state: lock %s: %w", path, err)
	}
	if err := f.Truncate(0); err == nil {
		_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &DirLock{f: f}, nil
}

// Release gives the dir up. The file stays: removing it would let a second
// process lock a fresh inode while a third still holds the old one.
func (l *DirLock) Release() error {
	if l == nil || l.f == nil {
		return nil
	}
	err := l.f.Close()
	l.f = nil
	return err
}
