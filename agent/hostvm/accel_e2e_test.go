package hostvm

import (
	"net/netip"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/qemu/qemutest"
	"github.com/a73x/eitri/agent/reconcile"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// accelLog collects the backend's OnAccelChange calls.
type accelLog struct {
	mu   sync.Mutex
	seen []qemu.Accel
}

func (l *accelLog) record(a qemu.Accel) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.seen = append(l.seen, a)
}

func (l *accelLog) all() []qemu.Accel {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]qemu.Accel(nil), l.seen...)
}

// wrappedQEMU runs QEMU through a shell script: body runs first, with $kvm
// set when the arguments ask for KVM and $vm when they start a VM
// (-daemonize) rather than an accelerator probe; the real QEMU then runs
// with "$@". The engine gets a budget of one create attempt: a KVM failure
// must never spend it.
func wrappedQEMU(t *testing.T, body string, log *accelLog) hostOption {
	t.Helper()
	bin, _ := qemutest.Wrap(t, body)
	return func(q *qemu.Config, e *reconcile.Config) {
		q.Binary = bin
		q.OnAccelChange = log.record
		e.MaxCreateAttempts = 1
	}
}

func guestCmdline(t *testing.T, h *host, id string) string {
	t.Helper()
	pid, ok := h.qemu.PID(id)
	require.True(t, ok, "vm %s has a QEMU", id)
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	require.NoError(t, err)
	return strings.ReplaceAll(string(data), "\x00", " ")
}

func attemptsOf(t *testing.T, h *host, id string) int {
	t.Helper()
	rec, ok, err := h.st.LoadVM(id)
	require.NoError(t, err)
	require.True(t, ok)
	assert.False(t, rec.Failed)
	return rec.CreateAttempts
}

// TestVMStartUnderBrokenKVMRunsUnderTCG: the probe passes under KVM but
// every VM QEMU under KVM aborts on the MSR assertion (a nested EPYC host).
// The VM still reaches ready, under TCG, on a budget of one attempt.
func TestVMStartUnderBrokenKVMRunsUnderTCG(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		dir, url, sha := netnsEnv(t)
		const id, name = "vm-e2e-msr", "msr-1"
		killLeftovers(t, dir, id)
		var changes accelLog
		// Probes pass under KVM; VM starts under KVM abort the way QEMU
		// does on such a host.
		h := startHost(t, dir, netip.MustParsePrefix("10.78.4.1/24"), true, wrappedQEMU(t, `
if [ -n "$kvm" ] && [ -n "$vm" ]; then
	echo 'qemu-system-x86_64: error: failed to set MSR 0x10a to 0x69' >&2
	echo "qemu-system-x86_64: ../target/i386/kvm/kvm.c:3208: kvm_buf_set_msrs: Assertion 'ret == cpu->kvm_msr_buf->nmsrs' failed." >&2
	exit 134
fi
`+qemutest.ProbesPassUnderKVM, &changes))
		t.Cleanup(func() { h.stop(t) })
		require.True(t, h.eng.Apply(snapshot(1, desiredVM(id, name, url, sha, "running"))))
		row := waitRow(t, h, id, readyWithin, "ready", isReady)
		assert.Empty(t, row.GetLastError())
		assert.Zero(t, attemptsOf(t, h, id), "KVM's failure is not the VM's")
		assert.Contains(t, guestCmdline(t, h, id), "-machine q35,accel=tcg -cpu max")

		got := h.qemu.Accel()
		t.Logf("accelerator: %+v; changes: %+v", got, changes.all())
		if !kvmDeviceOpens() {
			t.Logf("/dev/kvm is unusable here, so KVM was never tried: %s", got.Reason)
			return
		}
		assert.Equal(t, qemu.Accel{Name: "tcg", CPU: "max", Reason: "kvm unusable: failed to set MSR 0x10a in vm " + id + "; running under tcg"}, got)
		assert.Len(t, changes.all(), 3, "kvm -cpu host, kvm -cpu qemu64, tcg")
	})
}

// kvmDeviceOpens reports whether /dev/kvm opens read-write.
func kvmDeviceOpens() bool {
	f, err := os.OpenFile("/dev/kvm", os.O_RDWR, 0)
	if err != nil {
		return false
	}
	f.Close()
	return true
}

// TestGuestStoppedByKVMIsRetriedUnderTheNextAccelerator uses real KVM for
// VMs (probes are made to pass): under KVM the firmware boots a disk KVM
// cannot run, so the guest hits a real internal error while Boot waits for
// its address. The engine gets a host fault, refunds the attempt, and boots
// again under the host's next accelerator until TCG, where the real guest
// comes up.
func TestGuestStoppedByKVMIsRetriedUnderTheNextAccelerator(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		if !kvmDeviceOpens() {
			t.Skip("needs /dev/kvm to run a guest into a KVM internal error")
		}

		dir, url, sha := netnsEnv(t)
		const id, name = "vm-e2e-kvmfault", "kvmfault-1"
		killLeftovers(t, dir, id)
		var changes accelLog
		// Under KVM the firmware boots the MMIO disk first (bootindex 0).
		h := startHost(t, dir, netip.MustParsePrefix("10.78.5.1/24"), true, wrappedQEMU(t, `
if [ -n "$kvm" ] && [ -n "$vm" ]; then
	set -- "$@" -drive if=none,id=mmio,format=raw,readonly=on,file=`+qemutest.MMIODisk(t)+` -device virtio-blk-pci,drive=mmio,bootindex=0
fi`+qemutest.ProbesPassUnderKVM, &changes))
		t.Cleanup(func() { h.stop(t) })

		require.True(t, h.eng.Apply(snapshot(1, desiredVM(id, name, url, sha, "running"))))
		var details []string
		row := waitRow(t, h, id, readyWithin, "ready", func(r *eitriv1.ActualVM) bool {
			if d := r.GetStatusDetail(); len(details) == 0 || details[len(details)-1] != d {
				details = append(details, d)
			}
			return isReady(r)
		})
		t.Logf("details seen: %q", details)
		assert.Empty(t, row.GetLastError())
		assert.Zero(t, attemptsOf(t, h, id), "two KVM faults, a budget of one, nothing spent")
		assert.Contains(t, guestCmdline(t, h, id), "-machine q35,accel=tcg -cpu max")
		got := h.qemu.Accel()
		t.Logf("accelerator: %+v", got)
		// On hosts whose KVM aborts at start (the MSR assertion) the VM
		// never reaches its internal error; the outcome is the same.
		assert.Equal(t, "tcg", got.Name)
		// One cause when both CPU models failed alike, else each with its
		// model (a host whose -cpu host aborts on the MSR and whose
		// qemu64 guest then hits an internal error).
		vm := regexp.QuoteMeta(" in vm " + id)
		assert.Regexp(t, `^kvm unusable: (.+`+vm+`|.+`+vm+` with -cpu host, .+`+vm+` with -cpu qemu64); running under tcg$`, got.Reason)
		seen := changes.all()
		require.Len(t, seen, 3)
		assert.Equal(t, "host", seen[0].CPU)
		assert.Equal(t, "qemu64", seen[1].CPU)
		assert.Equal(t, "max", seen[2].CPU)
	})
}
