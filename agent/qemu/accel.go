package qemu

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/a73x/eitri/agent/permanent"
)

// AccelMode is how the backend may choose its accelerator (--accel).
type AccelMode string

const (
	// AccelAuto tries KVM (-cpu host, then a safer model) and falls back to TCG.
	AccelAuto AccelMode = "auto"
	// AccelKVM allows KVM only; the host runs no guests if KVM fails.
	AccelKVM AccelMode = "kvm"
	// AccelTCG uses TCG without trying KVM.
	AccelTCG AccelMode = "tcg"
)

// ParseAccelMode parses the value of --accel; empty means auto.
func ParseAccelMode(s string) (AccelMode, error) {
	switch m := AccelMode(strings.ToLower(strings.TrimSpace(s))); m {
	case "":
		return AccelAuto, nil
	case AccelAuto, AccelKVM, AccelTCG:
		return m, nil
	}
	return "", fmt.Errorf("invalid --accel %q: want auto, kvm or tcg", s)
}

// Accel is the accelerator guests run under and why it was chosen.
type Accel struct {
	// Name is "kvm" or "tcg"; empty when no accelerator the mode allows
	// works (Reason says why).
	Name string
	// CPU is the -cpu model guests get with it.
	CPU string
	// Reason is one sentence for people, e.g. "kvm unusable: failed to set
	// MSR 0x10a; running under tcg".
	Reason string
}

const (
	accelKVM  = "kvm"
	accelTCG  = "tcg"
	kvmDevice = "/dev/kvm"
)

// machineArgs are the machine and CPU arguments of every guest, shared by the
// probe and args so the probe proves exactly what VMs will run.
func machineArgs(a Accel) []string {
	return []string{"-machine", "q35,accel=" + a.Name, "-cpu", a.CPU}
}

// candidates are what a mode tries, best first. -cpu host passes the host's
// CPU through; qemu64 is a plain model that survives nested hosts whose KVM
// chokes on host MSRs; TCG runs anywhere.
func candidates(mode AccelMode) []Accel {
	kvm := []Accel{{Name: accelKVM, CPU: "host"}, {Name: accelKVM, CPU: "qemu64"}}
	tcg := Accel{Name: accelTCG, CPU: "max"}
	switch mode {
	case AccelKVM:
		return kvm
	case AccelTCG:
		return []Accel{tcg}
	}
	return append(kvm, tcg)
}

func sameCandidate(a, b Accel) bool { return a.Name == b.Name && a.CPU == b.CPU }

// probeFailure is why one candidate is not used.
type probeFailure struct {
	cand  Accel
	cause string
	// noDevice: /dev/kvm itself is unusable, so no KVM candidate was tried.
	noDevice bool
}

// Accel returns the accelerator guests start under: the last probe's
// choice, zero before any probe.
func (b *Backend) Accel() Accel {
	b.accelMu.Lock()
	defer b.accelMu.Unlock()
	return b.accel
}

// Probe boots a tiny guest under each candidate accelerator of the mode
// (KVM with -cpu host, KVM with qemu64, TCG with -cpu max) until one prints
// its line on the serial port, and records that choice for Start. A
// candidate a real VM has proved broken since is skipped. When none works
// it records an Accel with only a Reason and returns a permanent error.
// A probe cut short by ctx records nothing.
func (b *Backend) Probe(ctx context.Context) (Accel, error) {
	b.probeMu.Lock()
	defer b.probeMu.Unlock()
	return b.probeLocked(ctx)
}

// current is the recorded choice, probing first if there is none.
func (b *Backend) current(ctx context.Context) (Accel, error) {
	if a, err, ok := b.recorded(); ok {
		return a, err
	}
	b.probeMu.Lock()
	defer b.probeMu.Unlock()
	if a, err, ok := b.recorded(); ok {
		return a, err // another caller probed while we waited
	}
	return b.probeLocked(ctx)
}

func (b *Backend) recorded() (Accel, error, bool) {
	b.accelMu.Lock()
	defer b.accelMu.Unlock()
	return b.accel, b.probeErr, b.probed
}

// probeLocked runs a probe; b.probeMu is held.
func (b *Backend) probeLocked(ctx context.Context) (Accel, error) {
	bin, err := b.binary()
	if err != nil {
		return Accel{}, err
	}
	dir, err := os.MkdirTemp(b.cfg.Dir, probeDirPrefix)
	if err != nil {
		return Accel{}, fmt.Errorf("qemu: accelerator probe: %w", err)
	}
	defer os.RemoveAll(dir)
	disk := filepath.Join(dir, "probe.raw")
	if err := writeProbeDisk(disk); err != nil {
		return Accel{}, fmt.Errorf("qemu: accelerator probe: %w", err)
	}

	b.accelMu.Lock()
	failed := slices.Clone(b.demoted)
	b.accelMu.Unlock()
	demoted := func(c Accel) bool {
		return slices.ContainsFunc(failed, func(f probeFailure) bool { return sameCandidate(f.cand, c) })
	}

	var chosen *Accel
	devChecked, devProblem := false, ""
	for _, c := range candidates(b.cfg.Accel) {
		if demoted(c) {
			continue
		}
		if c.Name == accelKVM {
			if !devChecked {
				devChecked, devProblem = true, kvmDeviceProblem(b.kvmDevice)
			}
			if devProblem != "" {
				failed = append(failed, probeFailure{cand: c, cause: devProblem, noDevice: true})
				continue
			}
		}
		start := time.Now()
		cause := b.bootProbe(ctx, bin, disk, c)
		took := time.Since(start).Round(time.Millisecond)
		if ctx.Err() != nil {
			return Accel{}, fmt.Errorf("qemu: accelerator probe: %w", ctx.Err())
		}
		if cause == "" {
			b.log.Info("accelerator probe booted", "accel", c.Name, "cpu", c.CPU, "took", took)
			chosen = &c
			break
		}
		b.log.Warn("accelerator probe failed", "accel", c.Name, "cpu", c.CPU, "took", took, "cause", cause)
		failed = append(failed, probeFailure{cand: c, cause: cause})
	}

	var a Accel
	var perr error
	if chosen != nil {
		a = *chosen
		a.Reason = explain(b.cfg.Accel, failed, a)
	} else {
		a = Accel{Reason: explain(b.cfg.Accel, failed, Accel{})}
		perr = permanent.Errorf("qemu: no usable accelerator: %s", a.Reason)
	}
	b.accelMu.Lock()
	prev := b.accel
	b.accel, b.probeErr, b.probed = a, perr, true
	b.accelMu.Unlock()
	if a != prev {
		if perr != nil {
			b.log.Error("no usable accelerator; this host cannot run guests", "mode", b.cfg.Accel, "reason", a.Reason)
		} else {
			attrs := []any{"accel", a.Name, "cpu", a.CPU, "reason", a.Reason}
			if prev.Name != "" {
				attrs = append(attrs, "was", prev.Name+" -cpu "+prev.CPU)
			}
			b.log.Info("accelerator chosen", attrs...)
		}
		if b.cfg.OnAccelChange != nil {
			b.cfg.OnAccelChange(a)
		}
	}
	return a, perr
}

// kvmDeviceProblem says why dev cannot be used for KVM, "" when it opens
// read-write.
func kvmDeviceProblem(dev string) string {
	f, err := os.OpenFile(dev, os.O_RDWR, 0)
	if err == nil {
		f.Close()
		return ""
	}
	if errors.Is(err, fs.ErrNotExist) {
		return "no " + dev
	}
	var pe *fs.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	return fmt.Sprintf("cannot open %s: %v", dev, err)
}

// explain words a probe's outcome as one sentence. chosen.Name is empty when
// nothing worked.
func explain(mode AccelMode, failed []probeFailure, chosen Accel) string {
	switch {
	case chosen.Name == accelTCG && mode == AccelTCG:
		return "tcg chosen by --accel tcg"
	case chosen.Name == accelKVM && len(failed) == 0:
		return "kvm works with -cpu " + chosen.CPU
	case chosen.Name == accelKVM:
		var parts []string
		for _, f := range failed {
			parts = append(parts, fmt.Sprintf("kvm with -cpu %s failed (%s)", f.cand.CPU, f.cause))
		}
		return strings.Join(parts, "; ") + "; kvm works with -cpu " + chosen.CPU
	}
	why := kvmFailures(failed)
	if chosen.Name == accelTCG {
		return why + "; running under tcg"
	}
	return why + "; --accel kvm allows no fallback to tcg"
}

// kvmFailures words why KVM is not used: the device problem, or each
// distinct cause (with its CPU model when they differ).
func kvmFailures(failed []probeFailure) string {
	var causes []string
	for _, f := range failed {
		if f.noDevice {
			return f.cause
		}
		if !slices.Contains(causes, f.cause) {
			causes = append(causes, f.cause)
		}
	}
	switch len(causes) {
	case 0:
		return "kvm unusable"
	case 1:
		return "kvm unusable: " + causes[0]
	}
	parts := make([]string, 0, len(failed))
	for _, f := range failed {
		parts = append(parts, f.cause+" with -cpu "+f.cand.CPU)
	}
	return "kvm unusable: " + strings.Join(parts, ", ")
}

// accelFailed moves the host down its candidate list after a VM proved
// used broken (cause says how), and returns the new choice. If the choice
// already moved on (another VM got there first) it returns that instead.
func (b *Backend) accelFailed(ctx context.Context, used Accel, cause, vmID string) (Accel, error) {
	b.probeMu.Lock()
	defer b.probeMu.Unlock()
	b.accelMu.Lock()
	if b.probed && !sameCandidate(b.accel, used) {
		a, err := b.accel, b.probeErr
		b.accelMu.Unlock()
		return a, err
	}
	if !slices.ContainsFunc(b.demoted, func(f probeFailure) bool { return sameCandidate(f.cand, used) }) {
		b.demoted = append(b.demoted, probeFailure{cand: used, cause: cause + " in vm " + vmID})
	}
	// Should this probe be cut short, the next Start probes again rather
	// than reuse the broken choice.
	b.probed = false
	b.accelMu.Unlock()
	b.log.Warn("kvm failed a vm that its probe passed; probing again without it",
		"vm", vmID, "accel", used.Name, "cpu", used.CPU, "cause", cause)
	return b.probeLocked(ctx)
}

// AccelError says a VM's guest was stopped by a KVM failure and this host
// has moved to another accelerator: booting the VM again runs it under Now.
// The failure is the host's, not the VM's, so HostFault tells the reconcile
// engine not to spend one of the VM's attempts on it.
type AccelError struct {
	VM     string
	Failed Accel // what the guest ran under
	Cause  string
	Now    Accel // the host's choice from now on
}

func (e *AccelError) Error() string {
	return fmt.Sprintf("qemu: vm %s: kvm with -cpu %s failed (%s); this host now runs guests under %s with -cpu %s",
		e.VM, e.Failed.CPU, e.Cause, e.Now.Name, e.Now.CPU)
}

// HostFault marks the error as the host's fault, not the VM's.
func (e *AccelError) HostFault() bool { return true }

// kvmStartFault is a Start that failed because of KVM; Start retries it
// under the next choice.
type kvmStartFault struct {
	cause string
	err   error
}

func (e *kvmStartFault) Error() string { return e.err.Error() }
func (e *kvmStartFault) Unwrap() error { return e.err }

// CheckAccel looks for a guest stopped by KVM: its QEMU reports status
// "internal-error", or it died with a KVM error in its log. When it finds
// one it kills what is left, moves this host to its next accelerator (see
// Probe) and returns an *AccelError; otherwise nil. Guests under TCG are
// never checked.
func (b *Backend) CheckAccel(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	if pid, ok := b.alive(id); ok {
		used := accelOf(pid)
		if used.Name != accelKVM {
			return nil
		}
		st, err := b.status(ctx, id)
		if err != nil || st.Status != statusInternalError {
			return nil // QMP trouble is for Running to report
		}
		return b.recoverKVMFault(ctx, id, used, b.internalErrorCause(id))
	}
	if used, cause := b.deadKVMFault(id); cause != "" {
		return b.recoverKVMFault(ctx, id, used, cause)
	}
	return nil
}

const statusInternalError = "internal-error"

// internalErrorCause is the cause of a guest in QMP status internal-error.
func (b *Backend) internalErrorCause(id string) string {
	if c := qemuCause(b.qemuLog(id)); strings.Contains(c, "KVM") {
		return c
	}
	return "KVM internal error"
}

// deadKVMFault reports the KVM failure that ended a QEMU this backend
// started, once: the VM is forgotten either way, so a stopped VM is not
// blamed again on every later check.
func (b *Backend) deadKVMFault(id string) (Accel, string) {
	b.accelMu.Lock()
	used, ok := b.launched[id]
	delete(b.launched, id)
	b.accelMu.Unlock()
	if !ok || used.Name != accelKVM {
		return Accel{}, ""
	}
	if out := b.qemuLog(id); isKVMFailure(out) {
		return used, qemuCause(out)
	}
	return Accel{}, ""
}

// recoverKVMFault kills the VM's QEMU, moves the host off used and says so.
func (b *Backend) recoverKVMFault(ctx context.Context, id string, used Accel, cause string) error {
	b.log.Warn("guest stopped by kvm", "id", id, "cpu", used.CPU, "cause", cause)
	if err := b.Kill(ctx, id); err != nil {
		return err
	}
	// The host's fault, dealt with here: not an exit of the guest's own
	// for Exited to report (and count against the VM).
	b.cleanRuntime(id)
	b.forgetLaunched(id)
	now, err := b.accelFailed(ctx, used, cause, id)
	if err != nil {
		return fmt.Errorf("qemu: vm %s: kvm with -cpu %s failed (%s): %w", id, used.CPU, cause, err)
	}
	return &AccelError{VM: id, Failed: used, Cause: cause, Now: now}
}

func (b *Backend) setLaunched(id string, a Accel) {
	b.accelMu.Lock()
	defer b.accelMu.Unlock()
	b.launched[id] = Accel{Name: a.Name, CPU: a.CPU}
}

func (b *Backend) forgetLaunched(id string) {
	b.accelMu.Lock()
	defer b.accelMu.Unlock()
	delete(b.launched, id)
}

// accelOf reads the accelerator and CPU model from a running QEMU's
// command line.
func accelOf(pid int) Accel {
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return Accel{}
	}
	var a Accel
	args := strings.Split(string(cmdline), "\x00")
	for i := 0; i+1 < len(args); i++ {
		switch args[i] {
		case "-machine":
			for opt := range strings.SplitSeq(args[i+1], ",") {
				if v, ok := strings.CutPrefix(opt, "accel="); ok {
					a.Name = v
				}
			}
		case "-cpu":
			a.CPU = args[i+1]
		}
	}
	return a
}
