package qemu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// How a QEMU that ended unasked is told from one that was stopped, and how
// it ended.
//
// A QEMU this Backend started or adopted is watched (Backend.watched) until
// Shutdown, Kill or Destroy ends it; one that ends otherwise is reported
// once by Exited. A QEMU killed outright leaves its pidfile behind (a clean
// exit removes it), so after an agent restart a stale pidfile says the same.
//
// -daemonize makes QEMU a grandchild that its parent orphans, so its exit
// status would go to init. New makes this process a child subreaper: the
// orphaned QEMU is reparented here, stays a zombie when it dies until this
// package reaps it (with its status), and QEMUs started by an earlier agent
// process end with no status anyone here can read ("exit status unknown").

const (
	// serialKeepBytes bounds the serial log kept from the previous boot.
	serialKeepBytes = 1 << 20
	// exitTailLines is how much of the serial console an exit carries.
	exitTailLines = 20

	prSetChildSubreaper = 36 // PR_SET_CHILD_SUBREAPER, linux/prctl.h
	// reapWait bounds the wait for a child between losing its command line
	// and becoming reapable.
	reapWait = 2 * time.Second
)

// Exit is how a VM's QEMU ended when nobody asked it to.
type Exit struct {
	// Status is "signal 9", "status 1", or "" when it cannot be known.
	Status string
	// Detail is what QEMU's own log says about the end, when it says
	// anything ("terminating on signal 15 from pid 4242 (kill)").
	Detail string
	// SerialTail is the last lines of the serial console of the boot that
	// ended.
	SerialTail string
}

// Reason words the exit for people: "qemu exited (signal 9)".
func (x Exit) Reason() string {
	status := x.Status
	if status == "" {
		status = "exit status unknown"
	}
	if x.Detail != "" {
		status += ": " + x.Detail
	}
	return "qemu exited (" + status + ")"
}

// becomeSubreaper makes the orphaned QEMUs this process starts its
// children, so their exit status can be read. A failure only costs that.
func becomeSubreaper() error {
	if _, _, errno := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); errno != 0 {
		return errno
	}
	return nil
}

// watch records the pid of a QEMU this Backend started or adopted.
func (b *Backend) watch(id string, pid int) {
	b.mu.Lock()
	b.watched[id] = pid
	b.mu.Unlock()
}

// unwatch forgets the VM's QEMU because it was asked to end (or has been
// reported by Exited), reaping it if it is a zombie of this process.
func (b *Backend) unwatch(id string) {
	b.mu.Lock()
	pid, ok := b.watched[id]
	delete(b.watched, id)
	b.mu.Unlock()
	if ok {
		reap(pid)
	}
}

// Exited reports, once, that the VM's QEMU ended without Shutdown, Kill or
// Destroy ending it: a crash, a kill from outside, a host reboot. It is
// false while the QEMU runs, and for a VM whose QEMU was never started or
// was stopped on request.
func (b *Backend) Exited(id string) (Exit, bool) {
	if checkID(id) != nil {
		return Exit{}, false
	}
	l := b.lock(id)
	l.life.Lock()
	defer l.life.Unlock()

	b.mu.Lock()
	pid, watched := b.watched[id]
	b.mu.Unlock()
	if data, err := os.ReadFile(b.pidPath(id)); err == nil {
		if p, err := strconv.Atoi(strings.TrimSpace(string(data))); err == nil && p > 0 {
			pid, watched = p, true
		}
	}
	if !watched || b.isOurs(pid, id) {
		return Exit{}, false
	}
	b.settleSerial(id)
	x := Exit{Status: reap(pid), Detail: b.exitDetail(id), SerialTail: b.SerialTail(id, exitTailLines)}
	b.mu.Lock()
	delete(b.watched, id)
	b.mu.Unlock()
	b.cleanRuntime(id)
	b.log.Warn("vm's qemu exited unasked", "id", id, "pid", pid, "status", x.Status, "detail", x.Detail)
	return x, true
}

// exitDetail is the line QEMU logs when a signal ends it, if it logged one.
func (b *Backend) exitDetail(id string) string {
	for _, line := range strings.Split(b.qemuLog(id), "\n") {
		if i := strings.Index(line, "terminating on signal"); i >= 0 {
			return strings.TrimSpace(line[i:])
		}
	}
	return ""
}

// reap collects pid's exit status if it is a child of this process that
// has ended, and says how it ended; "" when it is not this process's child
// or still runs. A process ends in steps: its command line is gone (so it
// no longer reads as a VM's QEMU) a moment before it can be reaped, so a
// child caught in between is waited for, briefly.
func reap(pid int) string {
	var ws syscall.WaitStatus
	deadline := time.Now().Add(reapWait)
	for {
		got, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		if errors.Is(err, syscall.EINTR) {
			continue
		}
		if err != nil {
			return "" // not our child
		}
		if got == pid {
			break
		}
		if cmdline, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); len(cmdline) > 0 || time.Now().After(deadline) {
			return "" // still running
		}
		time.Sleep(2 * time.Millisecond)
	}
	switch {
	case ws.Signaled():
		return fmt.Sprintf("signal %d", int(ws.Signal()))
	case ws.Exited():
		return fmt.Sprintf("status %d", ws.ExitStatus())
	}
	return ""
}

// qemuChildren lists this process's QEMU children (the subreaper inherits
// every daemonized QEMU and its middle process), with their stat.
func qemuChildren() map[int]procStat {
	self := os.Getpid()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	out := map[int]procStat{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if st, ok := readStat(pid); ok && st.ppid == self && strings.HasPrefix(st.comm, "qemu-system") {
			out[pid] = st
		}
	}
	return out
}

// reapDaemonizeParents reaps the middle processes of -daemonize's double
// fork that the subreaper inherits as zombies, and returns their pids: each
// is the session of the QEMU it forked. They are found as zombie QEMU
// children of this process that lead their own session, which nothing else
// here starts: the QEMU os/exec waits for leads no session, and a guest's
// QEMU belongs to the session its middle process made.
func reapDaemonizeParents() (sessions []int) {
	for pid, st := range qemuChildren() {
		if st.state == 'Z' && st.session == pid {
			reap(pid)
			sessions = append(sessions, pid)
		}
	}
	return sessions
}

// reapFailedStart ends what a failed start of VM id left in the sessions
// its -daemonize made: the daemonized QEMU, if it died (a KVM abort at
// start) or is dying, is reaped, and one that still runs as this VM is
// killed first. Nothing else would ever wait for it: it was never watched,
// so without this it stays a zombie for the agent's life. A QEMU of another
// VM that happens to share the sessions (launched at the same moment) is
// left alone while it runs.
func (b *Backend) reapFailedStart(ctx context.Context, id string, sessions []int) {
	if len(sessions) == 0 {
		return
	}
	for pid, st := range qemuChildren() {
		if !slices.Contains(sessions, st.session) {
			continue
		}
		if st.state != 'Z' && b.isOurs(pid, id) {
			_ = b.killUnwatched(ctx, id, pid)
			continue
		}
		if cmdline, _ := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline"); st.state != 'Z' && len(cmdline) > 0 {
			continue // another VM's, running
		}
		reap(pid)
	}
}

// killUnwatched kills a QEMU this Backend started but never watched (its
// start failed) and reaps it: no Exited will ever ask for its status. The
// kill goes on when ctx has ended (a cancelled start), so nothing of it is
// left running.
func (b *Backend) killUnwatched(ctx context.Context, id string, pid int) error {
	err := b.killLocked(context.WithoutCancel(ctx), id, pid)
	reap(pid)
	return err
}

type procStat struct {
	comm                string
	state               byte
	ppid, pgrp, session int
}

// readStat parses /proc/<pid>/stat: "pid (comm) state ppid pgrp session ...".
func readStat(pid int) (procStat, bool) {
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procStat{}, false
	}
	s := string(data)
	open, close := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || close < open {
		return procStat{}, false
	}
	f := strings.Fields(s[close+1:])
	if len(f) < 4 || len(f[0]) != 1 {
		return procStat{}, false
	}
	var st procStat
	st.comm, st.state = s[open+1:close], f[0][0]
	var errs [3]error
	st.ppid, errs[0] = strconv.Atoi(f[1])
	st.pgrp, errs[1] = strconv.Atoi(f[2])
	st.session, errs[2] = strconv.Atoi(f[3])
	return st, errors.Join(errs[:]...) == nil
}

// rotateSerial keeps the previous boot's serial console as serial.log.1 (its
// last serialKeepBytes) before a new QEMU truncates serial.log: the console
// of a boot that died is what explains it.
func (b *Backend) rotateSerial(id string) error {
	cur, old := b.serialPath(id), b.serialPath(id)+".1"
	f, err := os.Open(cur)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() == 0 {
		return nil // nothing worth replacing the last one with
	}
	if _, err := f.Seek(max(fi.Size()-serialKeepBytes, 0), io.SeekStart); err != nil {
		return err
	}
	tmp := old + ".tmp"
	out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return err
	}
	_, err = io.Copy(out, f)
	if cerr := out.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, old)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return err
	}
	return os.Remove(cur)
}

// PreviousSerialTail is the last lines of the serial console of the VM's
// boot before the current one ("" when there is none).
func (b *Backend) PreviousSerialTail(id string, lines int) string {
	if checkID(id) != nil || lines <= 0 {
		return ""
	}
	return fileTail(b.serialPath(id)+".1", lines)
}
