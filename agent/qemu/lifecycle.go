package qemu

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/a73x/eitri/agent/permanent"
)

// Start boots vm unless its QEMU is already running, in which case it does
// nothing: an agent restart or a repeated create must never boot a second
// QEMU on the same disk.
//
// The guest runs under the accelerator the last probe chose (Start probes
// first if nothing has). When QEMU fails at start because of KVM, Start
// moves the host to its next accelerator and boots again: KVM's fault is
// not the VM's.
func (b *Backend) Start(ctx context.Context, vm VM) error {
	if err := checkID(vm.ID); err != nil {
		return err
	}
	if vm.VCPUs <= 0 || vm.MemMB <= 0 {
		return permanent.Errorf("qemu: vm %s: vcpus (%d) and memory (%d MiB) must be positive", vm.ID, vm.VCPUs, vm.MemMB)
	}
	if vm.RootDisk == "" {
		return permanent.Errorf("qemu: vm %s: no root disk", vm.ID)
	}
	if vm.Tap != "" && len(vm.MAC) != 6 {
		return permanent.Errorf("qemu: vm %s: a NIC needs a 6-byte MAC, got %q", vm.ID, vm.MAC.String())
	}
	bin, err := b.binary()
	if err != nil {
		return err
	}
	if len(b.sockPath(vm.ID)) > maxUnixPath {
		return permanent.Errorf("qemu: QMP socket path %s is longer than %d bytes; use a shorter state dir", b.sockPath(vm.ID), maxUnixPath)
	}
	accel, err := b.current(ctx)
	if err != nil {
		return err
	}

	l := b.lock(vm.ID)
	l.life.Lock()
	defer l.life.Unlock()

	if pid, ok := b.alive(vm.ID); ok {
		b.log.Debug("vm already running", "id", vm.ID, "pid", pid)
		b.adoptSerial(vm.ID, pid)
		return nil
	}
	dir := b.VMDir(vm.ID)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("qemu: vm dir: %w", err)
	}

	rootFormat, err := diskFormat(vm.RootDisk)
	if err != nil {
		return fmt.Errorf("qemu: vm %s: root disk: %w", vm.ID, err)
	}
	if vm.SeedISO != "" {
		if _, err := os.Stat(vm.SeedISO); err != nil {
			return fmt.Errorf("qemu: vm %s: seed: %w", vm.ID, err)
		}
	}

	// Each round demotes the candidate that failed, and there are only a
	// few, so this ends.
	for range len(candidates(AccelAuto)) + 1 {
		err := b.launch(ctx, bin, vm, accel, rootFormat)
		var kf *kvmStartFault
		if !errors.As(err, &kf) {
			return err
		}
		b.log.Warn("vm start failed under kvm", "id", vm.ID, "cpu", accel.CPU, "cause", kf.cause)
		next, perr := b.accelFailed(ctx, accel, kf.cause, vm.ID)
		if perr != nil {
			return errors.Join(err, perr)
		}
		b.log.Info("starting vm again under the new accelerator", "id", vm.ID, "accel", next.Name, "cpu", next.CPU)
		accel = next
	}
	return fmt.Errorf("qemu: vm %s: no accelerator starts it", vm.ID)
}

// launch runs one QEMU for vm under accel. A failure KVM caused comes back
// as a *kvmStartFault. b.lock(vm.ID).life is held.
func (b *Backend) launch(ctx context.Context, bin string, vm VM, accel Accel, rootFormat string) error {
	_ = os.Remove(b.pidPath(vm.ID))
	_ = os.Remove(b.sockPath(vm.ID))
	_ = os.Remove(b.serialSockPath(vm.ID))
	_ = os.Remove(b.logPath(vm.ID))
	b.settleSerial(vm.ID) // the previous boot's output is all in its log
	if err := b.rotateSerial(vm.ID); err != nil {
		b.log.Warn("cannot keep the previous serial log; the new boot overwrites it", "id", vm.ID, "err", err)
	}
	capture, err := b.prepareSerial(vm.ID)
	if err != nil {
		return fmt.Errorf("qemu: vm %s: serial log: %w", vm.ID, err)
	}
	kvm := accel.Name == accelKVM
	kvmFault := func(out string, err error) error {
		if kvm && isKVMFailure(out) {
			return &kvmStartFault{cause: qemuCause(out), err: err}
		}
		return err
	}

	b.setLaunched(vm.ID, accel)
	cmd := exec.CommandContext(ctx, bin, b.args(vm, accel, rootFormat)...)
	// With -daemonize the parent exits once the guest is set up; the child
	// points its stdio at /dev/null (stderr at the -D log). WaitDelay guards
	// against a child that keeps our pipe open anyway.
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	sessions := reapDaemonizeParents()
	// QEMU has opened the pipe, or never will: reading it now ends at once
	// when it is gone.
	b.runSerial(vm.ID, capture)
	if err != nil {
		b.reapFailedStart(ctx, vm.ID, sessions)
		text := strings.TrimSpace(string(out) + "\n" + b.qemuLog(vm.ID))
		return kvmFault(text, fmt.Errorf("qemu: start vm %s: %w: %s", vm.ID, err, text))
	}
	pid, ok := b.alive(vm.ID)
	if !ok {
		b.reapFailedStart(ctx, vm.ID, sessions)
		b.settleSerial(vm.ID)
		logText, serial := b.qemuLog(vm.ID), b.SerialTail(vm.ID, 20)
		return kvmFault(logText+"\n"+serial,
			fmt.Errorf("qemu: vm %s exited right after start: %s", vm.ID, strings.TrimSpace(logText+"\n"+serial)))
	}
	st, err := b.status(ctx, vm.ID)
	if err != nil {
		// Half-started is worse than not started: the caller retries Start.
		_ = b.killUnwatched(ctx, vm.ID, pid)
		return fmt.Errorf("qemu: vm %s started but QMP does not answer: %w", vm.ID, err)
	}
	if kvm && st.Status == statusInternalError {
		cause := b.internalErrorCause(vm.ID)
		if err := b.killUnwatched(ctx, vm.ID, pid); err != nil {
			return err
		}
		return &kvmStartFault{cause: cause, err: fmt.Errorf("qemu: vm %s stopped at start: %s", vm.ID, cause)}
	}
	b.watch(vm.ID, pid)
	b.log.Info("vm started", "id", vm.ID, "pid", pid, "accel", accel.Name, "cpu", accel.CPU, "vcpus", vm.VCPUs, "mem_mb", vm.MemMB, "tap", vm.Tap)
	return nil
}

// alive reports the pid of this VM's QEMU if it is running. The process is
// identified by its command line naming this VM's pidfile, so a recycled pid
// or a zombie (empty cmdline) never counts.
func (b *Backend) alive(id string) (int, bool) {
	data, err := os.ReadFile(b.pidPath(id))
	if err != nil {
		return 0, false
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil || pid <= 0 {
		return 0, false
	}
	return pid, b.isOurs(pid, id)
}

func (b *Backend) isOurs(pid int, id string) bool {
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return false
	}
	args := strings.Split(string(cmdline), "\x00")
	want := b.pidPath(id)
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-pidfile" && args[i+1] == want {
			return true
		}
	}
	return false
}

// StartedAt is when the VM's running QEMU started (its pidfile is written
// at start), so a caller can ignore facts from an earlier boot.
func (b *Backend) StartedAt(id string) (time.Time, bool) {
	if checkID(id) != nil {
		return time.Time{}, false
	}
	if _, ok := b.alive(id); !ok {
		return time.Time{}, false
	}
	fi, err := os.Stat(b.pidPath(id))
	if err != nil {
		return time.Time{}, false
	}
	return fi.ModTime(), true
}

// PID returns the pid of the VM's running QEMU.
func (b *Backend) PID(id string) (int, bool) {
	if checkID(id) != nil {
		return 0, false
	}
	return b.alive(id)
}

func (b *Backend) status(ctx context.Context, id string) (qmpStatus, error) {
	var st qmpStatus
	err := b.qmp(ctx, id, func(q *qmpConn) error { return q.execute("query-status", nil, &st) })
	return st, err
}

// qmp runs fn on a fresh QMP session with this VM.
func (b *Backend) qmp(ctx context.Context, id string, fn func(*qmpConn) error) error {
	l := b.lock(id)
	l.qmp.Lock()
	defer l.qmp.Unlock()
	q, err := dialQMP(ctx, b.sockPath(id))
	if err != nil {
		return err
	}
	defer q.Close()
	return fn(q)
}

// Adopt takes over a VM left running by an earlier agent process. It
// reports false, with no error, when there is nothing to adopt (no pidfile,
// or the process is gone or is not this VM's QEMU). A process that is this
// VM's QEMU but does not answer QMP is an error, never "not running": the
// caller must not boot a second QEMU on the same disk.
func (b *Backend) Adopt(ctx context.Context, id string) (bool, error) {
	if err := checkID(id); err != nil {
		return false, err
	}
	pid, ok := b.alive(id)
	if !ok {
		return false, nil
	}
	st, err := b.status(ctx, id)
	if err != nil {
		return false, fmt.Errorf("qemu: adopt vm %s (pid %d): %w", id, pid, err)
	}
	b.watch(id, pid)
	b.adoptSerial(id, pid)
	b.log.Info("adopted running vm", "id", id, "pid", pid, "status", st.Status)
	return true, nil
}

// Running reports whether the VM's QEMU exists and its guest is running
// (QMP status "running"; paused or crashed guests are not).
//
// A guest KVM stopped (status "internal-error", or QEMU dead with a KVM
// error in its log) is not running either, and is cleared away: its QEMU
// is killed and the host moves to its next accelerator, so booting the VM
// again works. Only an error doing that is returned.
func (b *Backend) Running(ctx context.Context, id string) (bool, error) {
	if err := checkID(id); err != nil {
		return false, err
	}
	pid, ok := b.alive(id)
	if !ok {
		if used, cause := b.deadKVMFault(id); cause != "" {
			return false, ignoreAccelError(b.recoverKVMFault(ctx, id, used, cause))
		}
		return false, nil
	}
	st, err := b.status(ctx, id)
	if err != nil {
		// The guest may have powered off between the two checks.
		if _, ok := b.alive(id); !ok {
			return false, nil
		}
		return false, fmt.Errorf("qemu: vm %s: %w", id, err)
	}
	if st.Status == statusInternalError {
		if used := accelOf(pid); used.Name == accelKVM {
			return false, ignoreAccelError(b.recoverKVMFault(ctx, id, used, b.internalErrorCause(id)))
		}
	}
	return st.Status == "running", nil
}

// ignoreAccelError drops the *AccelError that reports a recovery which
// worked: the caller of Running only needs to know the guest is not running.
func ignoreAccelError(err error) error {
	var ae *AccelError
	if errors.As(err, &ae) {
		return nil
	}
	return err
}

// Shutdown presses the ACPI power button, waits up to ShutdownGrace for the
// guest to power off, then tells QEMU to quit and finally kills it.
func (b *Backend) Shutdown(ctx context.Context, id string) error {
	return b.ShutdownWith(ctx, id, nil)
}

// ShutdownWith is Shutdown that calls forcing (when set) once the guest has
// had ShutdownGrace to power off and has not, just before QEMU is made to
// quit, so the caller can say so.
func (b *Backend) ShutdownWith(ctx context.Context, id string, forcing func(grace time.Duration)) error {
	return b.withRunning(id, func(pid int) error { return b.shutdownLocked(ctx, id, pid, forcing) })
}

// shutdownLocked is ShutdownWith for the VM's running QEMU pid, with its
// lifecycle lock held.
func (b *Backend) shutdownLocked(ctx context.Context, id string, pid int, forcing func(grace time.Duration)) error {
	if err := b.qmp(ctx, id, func(q *qmpConn) error { return q.execute("system_powerdown", nil, nil) }); err != nil {
		b.log.Warn("acpi powerdown failed; quitting qemu", "id", id, "err", err)
	} else if gone, err := b.waitGone(ctx, id, pid, b.cfg.ShutdownGrace); err != nil {
		return err
	} else if gone {
		b.log.Info("vm powered off", "id", id, "pid", pid)
		b.cleanRuntime(id)
		return nil
	}

	b.log.Warn("guest did not power off in time; quitting qemu", "id", id, "grace", b.cfg.ShutdownGrace)
	if forcing != nil {
		forcing(b.cfg.ShutdownGrace)
	}
	// quit flushes disks, unlike SIGKILL. QEMU may close the socket before
	// answering, so the reply is not awaited strictly.
	if err := b.qmp(ctx, id, func(q *qmpConn) error { return q.execute("quit", nil, nil) }); err != nil {
		b.log.Debug("qmp quit", "id", id, "err", err)
	}
	if gone, err := b.waitGone(ctx, id, pid, quitGrace); err != nil || gone {
		if gone {
			b.cleanRuntime(id)
		}
		return err
	}
	return b.killLocked(ctx, id, pid)
}

// Kill stops the VM's QEMU at once with SIGKILL.
func (b *Backend) Kill(ctx context.Context, id string) error {
	return b.withRunning(id, func(pid int) error { return b.killLocked(ctx, id, pid) })
}

// withRunning runs fn with the pid of the VM's running QEMU, holding the
// VM's lifecycle lock; with none running there is nothing to do.
func (b *Backend) withRunning(id string, fn func(pid int) error) error {
	if err := checkID(id); err != nil {
		return err
	}
	l := b.lock(id)
	l.life.Lock()
	defer l.life.Unlock()
	pid, ok := b.alive(id)
	if !ok {
		return nil
	}
	return fn(pid)
}

func (b *Backend) killLocked(ctx context.Context, id string, pid int) error {
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		return fmt.Errorf("qemu: kill vm %s (pid %d): %w", id, pid, err)
	}
	gone, err := b.waitGone(ctx, id, pid, 10*time.Second)
	if err != nil {
		return err
	}
	if !gone {
		return fmt.Errorf("qemu: vm %s (pid %d) survived SIGKILL", id, pid)
	}
	b.log.Info("vm killed", "id", id, "pid", pid)
	b.cleanRuntime(id)
	return nil
}

// cleanRuntime removes what only a running QEMU needs, once it ended on
// request (or was reported by Exited); logs and disks stay.
func (b *Backend) cleanRuntime(id string) {
	b.unwatch(id)
	b.forgetSerial(id)
	b.settleSerial(id)
	_ = os.Remove(b.pidPath(id))
	_ = os.Remove(b.sockPath(id))
	_ = os.Remove(b.serialSockPath(id))
	_ = os.Remove(b.serialPipePath(id))
}

// waitGone polls until the process is no longer this VM's QEMU or d passes.
// QEMU is not our child after -daemonize, so there is nothing to wait(2) on.
func (b *Backend) waitGone(ctx context.Context, id string, pid int, d time.Duration) (bool, error) {
	deadline := time.NewTimer(d)
	defer deadline.Stop()
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if !b.isOurs(pid, id) {
			return true, nil
		}
		select {
		case <-ctx.Done():
			return false, ctx.Err()
		case <-deadline.C:
			return !b.isOurs(pid, id), nil
		case <-tick.C:
		}
	}
}

// Destroy kills the VM and removes its state directory: disks, seed, logs
// and sockets.
func (b *Backend) Destroy(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	if err := b.Kill(ctx, id); err != nil {
		return err
	}
	l := b.lock(id)
	l.life.Lock()
	defer l.life.Unlock()
	b.unwatch(id) // a QEMU that died unasked is reaped too
	b.stopSerial(id)
	if err := os.RemoveAll(b.VMDir(id)); err != nil {
		return fmt.Errorf("qemu: destroy vm %s: %w", id, err)
	}
	b.forgetLaunched(id)
	b.log.Info("vm destroyed", "id", id)
	return nil
}
