package qemu

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/permanent"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/qemu/qemutest"
)

// msrAbort is what QEMU prints when a nested host's KVM refuses the MSRs
// of -cpu host (seen on AMD EPYC), before it aborts with status 134.
const msrAbort = `qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69
qemu-system-x86_64: ../target/i386/kvm/kvm.c:3208: kvm_buf_set_msrs: Assertion ` + "`ret == cpu->kvm_msr_buf->nmsrs'" + ` failed.`

// kvmInternalError is how QEMU reports a guest KVM could not emulate; QEMU
// then stays up with the guest paused (QMP status "internal-error").
const kvmInternalError = `KVM internal error. Suberror: 1
extra data[0]: 0x0000000000000000
extra data[1]: 0x0000000000001000
emulation failure
EAX=00000011 EBX=00000000 ECX=00000000 EDX=00000000
`

func TestParseAccelMode(t *testing.T) {
	for in, want := range map[string]AccelMode{"": AccelAuto, "auto": AccelAuto, "kvm": AccelKVM, " TCG ": AccelTCG} {
		got, err := ParseAccelMode(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, got, in)
	}
	_, err := ParseAccelMode("hvf")
	require.Error(t, err)
	assert.Equal(t, `invalid --accel "hvf": want auto, kvm or tcg`, err.Error())

	_, err = New(Config{Dir: t.TempDir(), Accel: "xen"})
	assert.ErrorContains(t, err, "--accel")
}

func TestQEMUCauseIsShort(t *testing.T) {
	tests := []struct{ name, out, cause string }{
		{"msr assertion", msrAbort, "failed to set MSR 0x10a"},
		{"internal error", kvmInternalError, "KVM internal error (emulation failure)"},
		{"internal error, other suberror", "KVM internal error. Suberror: 3\n", "KVM internal error"},
		{"warnings skipped", "qemu-system-x86_64: warning: host doesn't support requested feature: CPUID.01H:ECX.pni [bit 0]\n" +
			"/usr/bin/qemu-system-x86_64: -drive file=/x: Could not open '/x': No such file or directory\n",
			"-drive file=/x: Could not open '/x': No such file or directory"},
		{"no kvm module", "qemu-system-x86_64: Could not access KVM kernel module: No such file or directory\nqemu-system-x86_64: failed to initialize kvm: No such file or directory\n",
			"Could not access KVM kernel module: No such file or directory"},
		{"nothing", "\n\n", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.cause, qemuCause(tc.out))
		})
	}

	assert.True(t, isKVMFailure(msrAbort))
	assert.True(t, isKVMFailure(kvmInternalError))
	assert.True(t, isKVMFailure("qemu-system-x86_64: failed to initialize kvm: Permission denied"))
	assert.True(t, isKVMFailure("qemu-system-x86_64: kvm_init_vcpu: kvm_arch_init_vcpu failed (-22): Invalid argument"))
	assert.False(t, isKVMFailure("qemu-system-x86_64: -drive file=/x: Could not open '/x': No such file or directory"))
	assert.False(t, isKVMFailure("[    0.000000] kvm-clock: using sched offset of 1 cycles"))
}

func TestExplain(t *testing.T) {
	host, safe, tcg := Accel{Name: "kvm", CPU: "host"}, Accel{Name: "kvm", CPU: "qemu64"}, Accel{Name: "tcg", CPU: "max"}
	msr := probeFailure{cand: host, cause: "failed to set MSR 0x10a"}
	emu := probeFailure{cand: safe, cause: "KVM internal error (emulation failure)"}
	tests := []struct {
		mode   AccelMode
		failed []probeFailure
		chosen Accel
		want   string
	}{
		{AccelAuto, nil, host, "kvm works with -cpu host"},
		{AccelAuto, []probeFailure{msr}, safe, "kvm with -cpu host failed (failed to set MSR 0x10a); kvm works with -cpu qemu64"},
		{AccelAuto, []probeFailure{msr, {cand: safe, cause: msr.cause}}, tcg, "kvm unusable: failed to set MSR 0x10a; running under tcg"},
		{AccelAuto, []probeFailure{msr, emu}, tcg, "kvm unusable: failed to set MSR 0x10a with -cpu host, KVM internal error (emulation failure) with -cpu qemu64; running under tcg"},
		{AccelAuto, []probeFailure{{cand: host, cause: "no /dev/kvm", noDevice: true}, {cand: safe, cause: "no /dev/kvm", noDevice: true}}, tcg, "no /dev/kvm; running under tcg"},
		{AccelTCG, nil, tcg, "tcg chosen by --accel tcg"},
		{AccelKVM, []probeFailure{msr, emu}, Accel{}, "kvm unusable: failed to set MSR 0x10a with -cpu host, KVM internal error (emulation failure) with -cpu qemu64; --accel kvm allows no fallback to tcg"},
	}
	for _, tc := range tests {
		assert.Equal(t, tc.want, explain(tc.mode, tc.failed, tc.chosen))
	}
}

func TestProbeDiskLayout(t *testing.T) {
	mbr := probeDisk()
	require.Len(t, mbr, 512)
	assert.Equal(t, []byte{0x55, 0xAA}, mbr[510:], "boot signature")
	msg := bytes.Index(mbr, []byte(probeMarker+"\r\n\x00"))
	require.Positive(t, msg)
	// mov esi, msg: the 64-bit code prints from the message's address.
	assert.Positive(t, bytes.Index(mbr, binary.LittleEndian.AppendUint32([]byte{0xBE}, uint32(0x7C00+msg))))
	assert.Less(t, msg+len(probeMarker)+3, 510, "all of it fits before the signature")

	path := filepath.Join(t.TempDir(), "probe.raw")
	require.NoError(t, writeProbeDisk(path))
	fi, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, int64(probeDiskSize), fi.Size(), "a one-sector disk does not boot")
}

// accelRecorder collects OnAccelChange calls.
type accelRecorder struct {
	mu   sync.Mutex
	seen []Accel
}

func (r *accelRecorder) record(a Accel) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seen = append(r.seen, a)
}

func (r *accelRecorder) all() []Accel {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.seen)
}

// probeBackend is a Backend whose QEMU binary is bin ("" for the real one),
// with a stand-in /dev/kvm that opens, so KVM candidates are tried on any
// machine (the wrappers decide what KVM does).
func probeBackend(t *testing.T, mode AccelMode, bin string) (*Backend, *accelRecorder) {
	t.Helper()
	rec := &accelRecorder{}
	b, err := New(Config{Dir: t.TempDir(), Log: hosttest.Logger(t), Binary: bin, Accel: mode, OnAccelChange: rec.record})
	require.NoError(t, err)
	if bin != "" {
		dev := filepath.Join(t.TempDir(), "kvm")
		require.NoError(t, os.WriteFile(dev, nil, 0o600))
		b.kvmDevice = dev
	}
	t.Cleanup(func() { assertNoQEMUUnder(t, b.cfg.Dir) })
	return b, rec
}

// kvmAborts makes every KVM run die the way a nested EPYC host's does.
const kvmAborts = `if [ -n "$kvm" ]; then
	cat >&2 <<'EOF'
` + msrAbort + `
EOF
	exit 134
fi`

// assertNoQEMUUnder fails if any live process still names dir on its
// command line (a probe or VM QEMU left behind).
func assertNoQEMUUnder(t *testing.T, dir string) {
	t.Helper()
	procs, err := filepath.Glob("/proc/[0-9]*/cmdline")
	require.NoError(t, err)
	for _, p := range procs {
		cmdline, err := os.ReadFile(p)
		if err != nil || !strings.Contains(string(cmdline), dir) {
			continue
		}
		pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(p)))
		if pid == os.Getpid() {
			continue
		}
		stat, err := os.ReadFile(filepath.Join(filepath.Dir(p), "stat"))
		if err == nil && strings.HasPrefix(strings.TrimSpace(string(stat[strings.LastIndexByte(string(stat), ')')+1:])), "Z") {
			continue // exited, waiting for init to reap it
		}
		t.Errorf("process %d left behind: %s", pid, strings.ReplaceAll(string(cmdline), "\x00", " "))
	}
}

func TestProbeChoosesAnAcceleratorThatBoots(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx := context.Background()
	b, rec := probeBackend(t, AccelAuto, "")
	assert.Zero(t, b.Accel(), "nothing chosen before a probe")

	a, err := b.Probe(ctx)
	require.NoError(t, err)
	t.Logf("chose %s -cpu %s: %s", a.Name, a.CPU, a.Reason)
	assert.Contains(t, candidates(AccelAuto), Accel{Name: a.Name, CPU: a.CPU})
	assert.NotEmpty(t, a.Reason)
	assert.Equal(t, a, b.Accel())
	if a.Name == "tcg" {
		assert.True(t, strings.HasSuffix(a.Reason, "; running under tcg"), a.Reason)
	}
	// What it chose really boots the probe guest.
	assert.Empty(t, b.bootProbe(ctx, defaultBinary, probeDiskFile(t), a))

	_, err = b.Probe(ctx)
	require.NoError(t, err)
	if b.Accel() == a {
		assert.Equal(t, []Accel{a}, rec.all(), "told once; the same result again is no change")
	}
}

func probeDiskFile(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "probe.raw")
	require.NoError(t, writeProbeDisk(path))
	return path
}

// TestProbeCandidatesOnThisMachine boots the probe under every candidate
// and logs how long each took. TCG must always boot; KVM is reported.
func TestProbeCandidatesOnThisMachine(t *testing.T) {
	hosttest.NeedQEMU(t)
	b := newBackend(t, 0)
	disk := probeDiskFile(t)
	devProblem := kvmDeviceProblem(kvmDevice)
	for _, c := range candidates(AccelAuto) {
		if c.Name == "kvm" && devProblem != "" {
			t.Logf("%s -cpu %s: not tried (%s)", c.Name, c.CPU, devProblem)
			continue
		}
		start := time.Now()
		cause := b.bootProbe(context.Background(), defaultBinary, disk, c)
		t.Logf("%s -cpu %s: %s, cause %q", c.Name, c.CPU, time.Since(start).Round(time.Millisecond), cause)
		if c.Name == "tcg" {
			assert.Empty(t, cause, "TCG boots anywhere")
		}
	}
	assertNoQEMUUnder(t, disk)
}

func TestProbeFallsBackToTCGWhenKVMAborts(t *testing.T) {
	hosttest.NeedQEMU(t)
	bin, calls := qemutest.Wrap(t, kvmAborts)
	b, rec := probeBackend(t, AccelAuto, bin)

	a, err := b.Probe(context.Background())
	require.NoError(t, err)
	want := Accel{Name: "tcg", CPU: "max", Reason: "kvm unusable: failed to set MSR 0x10a; running under tcg"}
	assert.Equal(t, want, a)
	assert.Equal(t, want, b.Accel())
	assert.Equal(t, []Accel{want}, rec.all())

	log, err := os.ReadFile(calls)
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(log)), "\n")
	require.Len(t, lines, 3, "kvm -cpu host, kvm -cpu qemu64, then tcg")
	assert.Contains(t, lines[0], "-machine q35,accel=kvm -cpu host")
	assert.Contains(t, lines[1], "-machine q35,accel=kvm -cpu qemu64")
	assert.Contains(t, lines[2], "-machine q35,accel=tcg -cpu max")
}

func TestProbeTimesOutASilentKVMGuest(t *testing.T) {
	hosttest.NeedQEMU(t)
	// A KVM guest that never prints: QEMU (here a stand-in) just sits there.
	pids := filepath.Join(t.TempDir(), "pids")
	bin, _ := qemutest.Wrap(t, `if [ -n "$kvm" ]; then echo $$ >>`+pids+`; exec sleep 600; fi`)
	b, _ := probeBackend(t, AccelAuto, bin)
	b.kvmProbeTimeout = 2 * time.Second

	start := time.Now()
	a, err := b.Probe(context.Background())
	require.NoError(t, err)
	assert.Equal(t, Accel{Name: "tcg", CPU: "max", Reason: "kvm unusable: probe guest printed nothing in 2s; running under tcg"}, a)
	assert.Less(t, time.Since(start), 20*time.Second, "each KVM candidate is bounded")
	data, err := os.ReadFile(pids)
	require.NoError(t, err)
	require.Len(t, strings.Fields(string(data)), 2, "both KVM candidates were tried")
	for _, pid := range strings.Fields(string(data)) {
		assert.NoFileExists(t, "/proc/"+pid+"/cmdline", "the silent guest %s was killed and reaped", pid)
	}
}

func TestProbeKVMModeFailsWhenKVMIsBroken(t *testing.T) {
	hosttest.NeedQEMU(t)
	bin, calls := qemutest.Wrap(t, kvmAborts)
	b, rec := probeBackend(t, AccelKVM, bin)

	a, err := b.Probe(context.Background())
	require.Error(t, err)
	assert.True(t, permanent.Is(err), "nothing on this host will change that: %v", err)
	assert.Equal(t, "qemu: no usable accelerator: kvm unusable: failed to set MSR 0x10a; --accel kvm allows no fallback to tcg", err.Error())
	assert.Empty(t, a.Name)
	assert.Equal(t, "kvm unusable: failed to set MSR 0x10a; --accel kvm allows no fallback to tcg", b.Accel().Reason)
	assert.Equal(t, []Accel{b.Accel()}, rec.all())
	log, err := os.ReadFile(calls)
	require.NoError(t, err)
	assert.NotContains(t, string(log), "accel=tcg")

	// Creates stop before downloading anything, and Start refuses.
	assert.Error(t, b.Preflight())
	vm := blankVM(t, b, "vm-kvm-only")
	err = b.Start(context.Background(), vm)
	require.Error(t, err)
	assert.True(t, permanent.Is(err))
}

func TestProbeTCGModeNeverTriesKVM(t *testing.T) {
	hosttest.NeedQEMU(t)
	bin, calls := qemutest.Wrap(t, kvmAborts)
	b, _ := probeBackend(t, AccelTCG, bin)
	a, err := b.Probe(context.Background())
	require.NoError(t, err)
	assert.Equal(t, Accel{Name: "tcg", CPU: "max", Reason: "tcg chosen by --accel tcg"}, a)
	log, err := os.ReadFile(calls)
	require.NoError(t, err)
	assert.NotContains(t, string(log), "accel=kvm")
}

func TestProbeWithoutKVMDevice(t *testing.T) {
	hosttest.NeedQEMU(t)
	bin, calls := qemutest.Wrap(t, "")
	b, _ := probeBackend(t, AccelAuto, bin)
	b.kvmDevice = filepath.Join(t.TempDir(), "kvm") // missing
	a, err := b.Probe(context.Background())
	require.NoError(t, err)
	assert.Equal(t, Accel{Name: "tcg", CPU: "max", Reason: "no " + b.kvmDevice + "; running under tcg"}, a)
	log, err := os.ReadFile(calls)
	require.NoError(t, err)
	assert.NotContains(t, string(log), "accel=kvm", "no KVM run without the device")
}

func TestProbeCutShortRecordsNothing(t *testing.T) {
	hosttest.NeedQEMU(t)
	bin, _ := qemutest.Wrap(t, `[ -n "$kvm" ] && exec sleep 600`)
	b, rec := probeBackend(t, AccelAuto, bin)
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	_, err := b.Probe(ctx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	assert.Zero(t, b.Accel())
	assert.Empty(t, rec.all())
	_, _, probed := b.recorded()
	assert.False(t, probed, "the next Start probes again")
}

// TestStartUnderBrokenKVMMovesDownAndRunsUnderTCG: the probe passes under
// KVM but every VM QEMU under KVM aborts. Start re-probes instead of
// failing, moves through -cpu qemu64 to TCG, and the VM runs.
func TestStartUnderBrokenKVMMovesDownAndRunsUnderTCG(t *testing.T) {
	hosttest.NeedQEMU(t)
	bin, _ := qemutest.Wrap(t, `if [ -n "$kvm" ] && [ -n "$vm" ]; then
	cat >&2 <<'EOF'
`+msrAbort+`
EOF
	exit 134
fi
`+qemutest.ProbesPassUnderKVM)
	b, rec := probeBackend(t, AccelAuto, bin)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	vm := blankVM(t, b, "vm-broken-kvm")
	t.Cleanup(func() { _ = b.Destroy(context.Background(), vm.ID) })

	require.NoError(t, b.Start(ctx, vm), "a KVM failure is the host's to handle, not the VM's")
	pid, ok := b.PID(vm.ID)
	require.True(t, ok)
	assert.Contains(t, strings.Join(procCmdline(t, pid), " "), "-machine q35,accel=tcg -cpu max")
	running, err := b.Running(ctx, vm.ID)
	require.NoError(t, err)
	assert.True(t, running)

	want := Accel{Name: "tcg", CPU: "max", Reason: "kvm unusable: failed to set MSR 0x10a in vm vm-broken-kvm; running under tcg"}
	assert.Equal(t, want, b.Accel())
	seen := rec.all()
	require.Len(t, seen, 3)
	assert.Equal(t, Accel{Name: "kvm", CPU: "host", Reason: "kvm works with -cpu host"}, seen[0])
	assert.Equal(t, Accel{Name: "kvm", CPU: "qemu64", Reason: "kvm with -cpu host failed (failed to set MSR 0x10a in vm vm-broken-kvm); kvm works with -cpu qemu64"}, seen[1])
	assert.Equal(t, want, seen[2])

	// Demoted candidates stay demoted: a later probe does not go back.
	a, err := b.Probe(ctx)
	require.NoError(t, err)
	assert.Equal(t, want, a)
	assert.Len(t, rec.all(), 3)
}

// TestGuestStoppedByKVMMovesTheHostDown runs a VM under real KVM that hits
// a real internal error after Start returned (the probe is made to pass
// under KVM). CheckAccel (what a boot wait calls) and Running (what the
// engine polls) both notice, kill the paused QEMU and move the host down its
// list; under TCG the same guest keeps running.
func TestGuestStoppedByKVMMovesTheHostDown(t *testing.T) {
	hosttest.NeedQEMU(t)
	if p := kvmDeviceProblem(kvmDevice); p != "" {
		t.Skipf("needs KVM to run a guest into a KVM internal error: %s", p)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	bin, _ := qemutest.Wrap(t, qemutest.ProbesPassUnderKVM)
	b, rec := probeBackend(t, AccelAuto, bin)
	b.kvmDevice = kvmDevice
	id := "vm-mmio"
	root := filepath.Join(b.VMDir(id), "root.raw")
	require.NoError(t, os.MkdirAll(b.VMDir(id), 0o700))
	require.NoError(t, os.Rename(qemutest.MMIODisk(t), root))
	vm := VM{ID: id, VCPUs: 1, MemMB: 64, RootDisk: root}
	t.Cleanup(func() { _ = b.Destroy(context.Background(), id) })

	// Under -cpu host: CheckAccel finds the guest stopped.
	require.NoError(t, b.Start(ctx, vm))
	if a := b.Accel(); a.CPU != "host" {
		t.Skipf("KVM fails at start here, before any guest runs (%s); TestStartUnderBrokenKVMMovesDownAndRunsUnderTCG covers that", a.Reason)
	}
	var ae *AccelError
	require.Eventually(t, func() bool {
		return errors.As(b.CheckAccel(ctx, id), &ae)
	}, 30*time.Second, 100*time.Millisecond, "KVM stops the guest")
	t.Logf("accel error: %v", ae)
	assert.Equal(t, Accel{Name: "kvm", CPU: "host"}, ae.Failed)
	assert.Equal(t, "KVM internal error (emulation failure)", ae.Cause)
	assert.True(t, ae.HostFault())
	_, alive := b.PID(id)
	assert.False(t, alive, "the paused QEMU is gone")
	assert.NoError(t, b.CheckAccel(ctx, id), "reported once")
	assert.Equal(t, Accel{Name: "kvm", CPU: "qemu64", Reason: "kvm with -cpu host failed (KVM internal error (emulation failure) in vm vm-mmio); kvm works with -cpu qemu64"}, ae.Now)

	// Under -cpu qemu64: Running finds it, and says only "not running".
	require.NoError(t, b.Start(ctx, vm))
	require.Eventually(t, func() bool {
		running, err := b.Running(ctx, id)
		require.NoError(t, err)
		return !running
	}, 30*time.Second, 100*time.Millisecond, "KVM stops the guest again")
	_, alive = b.PID(id)
	assert.False(t, alive)
	want := Accel{Name: "tcg", CPU: "max", Reason: "kvm unusable: KVM internal error (emulation failure) in vm vm-mmio; running under tcg"}
	assert.Equal(t, want, b.Accel())
	assert.Len(t, rec.all(), 3)

	// Under TCG the guest stays up.
	require.NoError(t, b.Start(ctx, vm))
	time.Sleep(2 * time.Second)
	running, err := b.Running(ctx, id)
	require.NoError(t, err)
	assert.True(t, running)
	assert.NoError(t, b.CheckAccel(ctx, id))
	pid, ok := b.PID(id)
	require.True(t, ok)
	assert.Contains(t, strings.Join(procCmdline(t, pid), " "), "-machine q35,accel=tcg -cpu max")
}
