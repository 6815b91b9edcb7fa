package upgrade

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// guardEnv names the upgrade dir to a process started as a guard.
const guardEnv = "EITRI_UPGRADE_GUARD"

// startGuard starts the previous build as the guard of the new one. It
// outlives the agent's exec (it is a child, not part of the image), and is
// released: nothing waits for it.
func startGuard(previous, dir string) error {
	cmd := exec.Command(previous)
	cmd.Env = append(os.Environ(), guardEnv+"="+dir)
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	return cmd.Process.Release()
}

// Guard runs the guard when this process was started as one, and reports
// whether it was; main calls it first, before anything else. The guard
// ends once the new build commits, or it rolls the new build back: it puts
// the previous build back in place, writes down what failed, and — unless a
// service manager restarts the agent (systemd's Restart=) — execs the
// previous build itself, so the host is never left without an agent.
func Guard() (ran bool, code int) {
	dir := os.Getenv(guardEnv)
	if dir == "" {
		return false, 0
	}
	_ = os.Unsetenv(guardEnv)
	if err := guard(dir, 100*time.Millisecond, 5*time.Second); err != nil {
		fmt.Fprintf(os.Stderr, "eitri upgrade guard: %v\n", err)
		return true, 1
	}
	return true, 0
}

func guard(dir string, poll, killGrace time.Duration) error {
	path := filepath.Join(dir, trialFile)
	for {
		var t trial
		ok, err := readJSON(path, &t)
		switch {
		case err != nil:
			return err
		case !ok || t.Committed:
			return nil // proved, or already handled
		}
		switch {
		case !alive(t.PID):
			return rollback(dir, t, fmt.Sprintf("agent %s exited before it reconnected", t.Target))
		case time.Now().After(t.Deadline):
			stop(t.PID, killGrace)
			return rollback(dir, t, fmt.Sprintf("agent %s did not reconnect and report within %s", t.Target,
				t.Deadline.Sub(t.Started).Round(time.Second)))
		}
		time.Sleep(poll)
	}
}

// rollback puts the previous build back and says why, then restarts it
// unless a service manager will.
func rollback(dir string, t trial, why string) error {
	if err := copyFile(t.Previous, t.Exe); err != nil {
		return fmt.Errorf("put the previous build back: %w", err)
	}
	msg := why + "; rolled back to " + t.From
	out := outcome{Target: t.Target, Step: StepFailed, Detail: msg, Error: msg, RolloutID: t.RolloutID, Attempt: t.Attempt,
		SHA256: t.SHA256, At: time.Now()}
	if err := writeJSON(filepath.Join(dir, outcomeFile), out); err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(dir, trialFile)); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "eitri upgrade guard: %s\n", msg)
	if managed(t.Env) {
		return nil
	}
	if t.Dir != "" {
		_ = os.Chdir(t.Dir)
	}
	return syscall.Exec(t.Exe, t.Args, t.Env)
}

// managed reports an agent a service manager restarts on its own: systemd
// sets INVOCATION_ID for every unit it runs.
func managed(env []string) bool {
	for _, e := range env {
		if strings.HasPrefix(e, "INVOCATION_ID=") {
			return true
		}
	}
	return false
}

// alive reports a process that exists and has not exited (a zombie, exited
// but not yet reaped by its parent, counts as gone).
func alive(pid int) bool {
	if pid <= 0 || syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	// The state follows the command name in parentheses, which may itself
	// hold spaces and parentheses.
	s := string(b)
	if i := strings.LastIndexByte(s, ')'); i >= 0 && i+2 < len(s) {
		return s[i+2] != 'Z'
	}
	return true
}

// stop asks the unhealthy agent to end, then makes it.
func stop(pid int, grace time.Duration) {
	_ = syscall.Kill(pid, syscall.SIGTERM)
	deadline := time.Now().Add(grace)
	for alive(pid) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if alive(pid) {
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// Exec hands this process over to the new build: the same pid, so a
// service manager sees one agent throughout, and the guard watches the pid
// it was told.
func Exec(r *Restart) error {
	return syscall.Exec(r.Exe, os.Args, os.Environ())
}
