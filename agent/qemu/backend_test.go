package qemu

import (
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/permanent"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// sparseFile makes a sparse file of the given size: a stand-in base image.
func sparseFile(t testing.TB, path string, size int64) {
	t.Helper()
	f, err := os.Create(path)
	require.NoError(t, err)
	require.NoError(t, f.Truncate(size))
	require.NoError(t, f.Close())
}

type imgInfo struct {
	VirtualSize   int64  `json:"virtual-size"`
	Format        string `json:"format"`
	BackingFile   string `json:"backing-filename"`
	BackingFormat string `json:"backing-filename-format"`
}

func qemuImgInfo(t *testing.T, path string) imgInfo {
	t.Helper()
	// -U: the image may be open by a running QEMU.
	out, err := exec.Command(defaultImgBinary, "info", "-U", "--output=json", path).Output()
	require.NoError(t, err)
	var info imgInfo
	require.NoError(t, json.Unmarshal(out, &info))
	return info
}

func newBackend(t testing.TB, grace time.Duration) *Backend {
	t.Helper()
	b, err := New(Config{Dir: t.TempDir(), Log: hosttest.Logger(t), ShutdownGrace: grace})
	require.NoError(t, err)
	return b
}

func TestPrepareRootDisk(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx := context.Background()
	b := newBackend(t, 0)
	dir := t.TempDir()
	base := filepath.Join(dir, "base.raw")
	sparseFile(t, base, 2<<30)

	dst := filepath.Join(b.VMDir("vm1"), "root.qcow2")
	require.NoError(t, b.PrepareRootDisk(ctx, dst, base, 5))

	info := qemuImgInfo(t, dst)
	assert.Equal(t, int64(5<<30), info.VirtualSize)
	assert.Equal(t, "qcow2", info.Format)
	assert.Equal(t, "raw", info.BackingFormat)
	assert.Equal(t, dst+".base", info.BackingFile, "overlay should reference the pinned hard link")
	assert.NoFileExists(t, dst+".tmp")

	// The pin keeps the base alive when the cache evicts it.
	require.NoError(t, os.Remove(base))
	fi, err := os.Stat(dst + ".base")
	require.NoError(t, err)
	assert.Equal(t, int64(2<<30), fi.Size())

	// A second call keeps the existing disk (it may hold guest data).
	require.NoError(t, os.WriteFile(filepath.Join(dir, "other.raw"), nil, 0o600))
	before, err := os.ReadFile(dst)
	require.NoError(t, err)
	require.NoError(t, b.PrepareRootDisk(ctx, dst, filepath.Join(dir, "other.raw"), 9))
	after, err := os.ReadFile(dst)
	require.NoError(t, err)
	assert.Equal(t, before, after)
}

func TestPrepareRootDiskErrors(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx := context.Background()
	dir := t.TempDir()
	base := filepath.Join(dir, "base.raw")
	sparseFile(t, base, 3<<30)

	tests := []struct {
		name      string
		cfg       Config
		base      string
		sizeGB    int64
		permanent bool
	}{
		{name: "disk smaller than image", base: base, sizeGB: 2, permanent: true},
		{name: "zero size", base: base, sizeGB: 0, permanent: true},
		{name: "qemu-img missing", cfg: Config{ImgBinary: "/nonexistent/qemu-img"}, base: base, sizeGB: 4, permanent: true},
		{name: "base missing", base: filepath.Join(dir, "nope.raw"), sizeGB: 4, permanent: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.Dir = t.TempDir()
			b, err := New(cfg)
			require.NoError(t, err)
			dst := filepath.Join(cfg.Dir, "root.qcow2")
			err = b.PrepareRootDisk(ctx, dst, tc.base, tc.sizeGB)
			require.Error(t, err)
			assert.Equal(t, tc.permanent, permanent.Is(err), "err: %v", err)
			assert.NoFileExists(t, dst)
			assert.NoFileExists(t, dst+".tmp")
		})
	}
}

func BenchmarkPrepareRootDisk(b *testing.B) {
	hosttest.NeedQEMU(b)
	ctx := context.Background()
	for _, sizeGB := range []int64{2, 8} {
		b.Run(strconv.FormatInt(sizeGB, 10)+"GiB", func(b *testing.B) {
			be, err := New(Config{Dir: b.TempDir(), Log: slog.New(slog.DiscardHandler)})
			require.NoError(b, err)
			base := filepath.Join(b.TempDir(), "base.raw")
			sparseFile(b, base, sizeGB<<30)
			b.ResetTimer()
			for i := 0; b.Loop(); i++ {
				dst := filepath.Join(be.VMDir("bench"), strconv.Itoa(i)+".qcow2")
				if err := be.PrepareRootDisk(ctx, dst, base, sizeGB+1); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// blankVM is a VM with an empty disk: SeaBIOS finds nothing to boot, but
// QEMU runs and QMP reports "running", which is all the lifecycle needs.
func blankVM(t *testing.T, b *Backend, id string) VM {
	t.Helper()
	base := filepath.Join(t.TempDir(), "blank.raw")
	sparseFile(t, base, 64<<20)
	root := filepath.Join(b.VMDir(id), "root.qcow2")
	require.NoError(t, b.PrepareRootDisk(context.Background(), root, base, 1))
	seed := filepath.Join(b.VMDir(id), "seed.iso")
	require.NoError(t, os.WriteFile(seed, make([]byte, 64<<10), 0o600))
	return VM{ID: id, VCPUs: 1, MemMB: 128, DiskGB: 1, RootDisk: root, SeedISO: seed}
}

func procCmdline(t *testing.T, pid int) []string {
	t.Helper()
	data, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	require.NoError(t, err)
	return strings.Split(strings.TrimRight(string(data), "\x00"), "\x00")
}

func TestLifecycleStartAdoptShutdownDestroy(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// A blank guest has no OS to honour the ACPI power button, so a short
	// grace exercises the quit fallback.
	b := newBackend(t, 300*time.Millisecond)
	vm := blankVM(t, b, "vm-life")
	t.Cleanup(func() { _ = b.Destroy(context.Background(), vm.ID) })

	require.NoError(t, b.Start(ctx, vm))
	pid, ok := b.PID(vm.ID)
	require.True(t, ok)
	running, err := b.Running(ctx, vm.ID)
	require.NoError(t, err)
	assert.True(t, running)

	args := procCmdline(t, pid)
	accel := b.Accel()
	require.NotEmpty(t, accel.Name, "Start probed for an accelerator")
	assert.Contains(t, strings.Join(args, " "), strings.Join(machineArgs(accel), " "), "the guest runs under what the probe chose")
	assert.Contains(t, args, "-daemonize")
	assert.Contains(t, args, "-nic")
	assert.NotContains(t, args, "-no-reboot", "a reboot inside the guest must reboot it")
	assert.Contains(t, strings.Join(args, " "), "format=raw,readonly=on,file="+vm.SeedISO)

	// Starting again must not boot a second QEMU.
	require.NoError(t, b.Start(ctx, vm))
	again, ok := b.PID(vm.ID)
	require.True(t, ok)
	assert.Equal(t, pid, again)

	// A second backend over the same dir is the agent after a restart.
	b2 := newBackendAt(t, b.cfg.Dir, 300*time.Millisecond)
	adopted, err := b2.Adopt(ctx, vm.ID)
	require.NoError(t, err)
	assert.True(t, adopted)
	pid2, ok := b2.PID(vm.ID)
	require.True(t, ok)
	assert.Equal(t, pid, pid2, "adopting must not restart the VM")
	running, err = b2.Running(ctx, vm.ID)
	require.NoError(t, err)
	assert.True(t, running)

	require.NoError(t, b2.Shutdown(ctx, vm.ID))
	running, err = b2.Running(ctx, vm.ID)
	require.NoError(t, err)
	assert.False(t, running)
	assertGone(t, pid)
	adopted, err = b2.Adopt(ctx, vm.ID)
	require.NoError(t, err)
	assert.False(t, adopted)

	// Start again, then the hard way.
	require.NoError(t, b2.Start(ctx, vm))
	pid3, ok := b2.PID(vm.ID)
	require.True(t, ok)
	require.NoError(t, b2.Kill(ctx, vm.ID))
	running, err = b2.Running(ctx, vm.ID)
	require.NoError(t, err)
	assert.False(t, running)
	assertGone(t, pid3)

	require.NoError(t, b2.Start(ctx, vm))
	pid4, ok := b2.PID(vm.ID)
	require.True(t, ok)
	require.NoError(t, b2.Destroy(ctx, vm.ID))
	assert.NoDirExists(t, b2.VMDir(vm.ID))
	assertGone(t, pid4)
	entries, err := os.ReadDir(b2.cfg.Dir)
	require.NoError(t, err)
	assert.Empty(t, entries, "destroy must leave nothing behind")

	// Everything is idempotent on a VM that is gone.
	require.NoError(t, b2.Shutdown(ctx, vm.ID))
	require.NoError(t, b2.Kill(ctx, vm.ID))
	require.NoError(t, b2.Destroy(ctx, vm.ID))
}

// assertGone checks that pid no longer runs. It may linger briefly as a
// zombie: after -daemonize QEMU is reaped by init, not by us.
func assertGone(t *testing.T, pid int) {
	t.Helper()
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return
	}
	// Field 3 follows the parenthesised command name.
	fields := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
	require.NotEmpty(t, fields)
	assert.Equal(t, "Z", fields[0], "pid %d still running", pid)
}

func newBackendAt(t *testing.T, dir string, grace time.Duration) *Backend {
	t.Helper()
	b, err := New(Config{Dir: dir, Log: hosttest.Logger(t), ShutdownGrace: grace})
	require.NoError(t, err)
	return b
}

func TestAdoptIgnoresForeignProcess(t *testing.T) {
	b := newBackend(t, 0)
	id := "vm-stale"
	require.NoError(t, os.MkdirAll(b.VMDir(id), 0o700))
	// A recycled pid: the pidfile names a live process that is not QEMU.
	require.NoError(t, os.WriteFile(b.pidPath(id), []byte(strconv.Itoa(os.Getpid())+"\n"), 0o600))

	adopted, err := b.Adopt(context.Background(), id)
	require.NoError(t, err)
	assert.False(t, adopted)
	running, err := b.Running(context.Background(), id)
	require.NoError(t, err)
	assert.False(t, running)
	require.NoError(t, b.Kill(context.Background(), id), "must not signal a foreign process")

	adopted, err = b.Adopt(context.Background(), "never-created")
	require.NoError(t, err)
	assert.False(t, adopted)
}

func TestStartRejects(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	root := filepath.Join(dir, "root.raw")
	sparseFile(t, root, 1<<20)
	good := VM{ID: "vm1", VCPUs: 1, MemMB: 128, RootDisk: root}

	tests := []struct {
		name string
		cfg  Config
		edit func(*VM)
	}{
		{name: "qemu missing", cfg: Config{Binary: "/nonexistent/qemu-system-x86_64"}},
		{name: "bad id", edit: func(vm *VM) { vm.ID = "../escape" }},
		{name: "no vcpus", edit: func(vm *VM) { vm.VCPUs = 0 }},
		{name: "no memory", edit: func(vm *VM) { vm.MemMB = 0 }},
		{name: "no root disk", edit: func(vm *VM) { vm.RootDisk = "" }},
		{name: "tap without mac", edit: func(vm *VM) { vm.Tap = "tap0" }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			cfg.Dir = t.TempDir()
			b, err := New(cfg)
			require.NoError(t, err)
			vm := good
			if tc.edit != nil {
				tc.edit(&vm)
			}
			err = b.Start(ctx, vm)
			require.Error(t, err)
			assert.True(t, permanent.Is(err), "err: %v", err)
		})
	}
}

func TestArgsWithTap(t *testing.T) {
	b := newBackend(t, 0)
	mac := []byte{0x52, 0x54, 0x00, 0xaa, 0xbb, 0xcc}
	args := strings.Join(b.args(VM{ID: "vm1", VCPUs: 2, MemMB: 256, RootDisk: "/d/a,b.qcow2", Tap: "eitri-t1", MAC: mac}, Accel{Name: "kvm", CPU: "host"}, "qcow2"), " ")
	assert.Contains(t, args, "-machine q35,accel=kvm -cpu host")
	assert.Contains(t, args, "-smp 2 -m 256M")
	assert.Contains(t, args, "tap,id=net0,ifname=eitri-t1,script=no,downscript=no")
	assert.Contains(t, args, "virtio-net-pci,netdev=net0,mac=52:54:00:aa:bb:cc")
	assert.Contains(t, args, "file=/d/a,,b.qcow2", "commas in paths must be escaped")
	assert.NotContains(t, args, "-nic none")
	assert.NotContains(t, args, "id=seed")
}

func TestSerialTail(t *testing.T) {
	b := newBackend(t, 0)
	id := "vm-serial"
	assert.Empty(t, b.SerialTail(id, 5), "no log yet")

	require.NoError(t, os.MkdirAll(b.VMDir(id), 0o700))
	log := "\x1b[2J\x1b[0;1mSeaBIOS\x1b[0m\r\nline one\r\nline two\r\n\x07Kernel panic - not syncing: VFS\r\n"
	require.NoError(t, os.WriteFile(b.serialPath(id), []byte(log), 0o600))

	assert.Equal(t, "line two\nKernel panic - not syncing: VFS", b.SerialTail(id, 2))
	assert.Equal(t, "SeaBIOS\nline one\nline two\nKernel panic - not syncing: VFS", b.SerialTail(id, 100))
}

func TestSerialTailLargeLog(t *testing.T) {
	b := newBackend(t, 0)
	id := "vm-big"
	require.NoError(t, os.MkdirAll(b.VMDir(id), 0o700))
	var sb strings.Builder
	for i := range 20000 {
		sb.WriteString("boot line " + strconv.Itoa(i) + "\n")
	}
	require.NoError(t, os.WriteFile(b.serialPath(id), []byte(sb.String()), 0o600))
	assert.Equal(t, "boot line 19998\nboot line 19999", b.SerialTail(id, 2))
}

func TestRequirements(t *testing.T) {
	missing := requirements("/nonexistent/qemu-system-x86_64", "/nonexistent/qemu-img")
	require.Len(t, missing, 2)
	assert.Contains(t, missing[0], "apt-get install qemu-system-x86")
	assert.Contains(t, missing[1], "apt-get install qemu-utils")
	assert.Empty(t, requirements("/bin/sh", "/bin/sh"))
}

// TestBootGuestImage boots the project's guest image when one is built
// (EITRI_GUEST_IMAGE=path to the raw disk).
func TestBootGuestImage(t *testing.T) {
	image := os.Getenv("EITRI_GUEST_IMAGE")
	if image == "" {
		t.Skip("EITRI_GUEST_IMAGE not set (build it with guestimage/build.sh)")
	}
	hosttest.NeedQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	b := newBackend(t, 20*time.Second)
	id := "vm-boot"
	fi, err := os.Stat(image)
	require.NoError(t, err)
	root := filepath.Join(b.VMDir(id), "root.qcow2")
	require.NoError(t, b.PrepareRootDisk(ctx, root, image, fi.Size()>>30+1))
	t.Cleanup(func() { _ = b.Destroy(context.Background(), id) })
	require.NoError(t, b.Start(ctx, VM{ID: id, VCPUs: 1, MemMB: 256, DiskGB: 1, RootDisk: root}))

	// Firmware prints nothing on the serial port here, so any output is the
	// guest's own (its kernel may boot quietly).
	require.Eventually(t, func() bool { return b.SerialTail(id, 1) != "" }, 2*time.Minute, 200*time.Millisecond,
		"the guest never wrote to its serial console")
	time.Sleep(3 * time.Second) // let it reach its init before pressing the button
	t.Logf("serial tail:\n%s", b.SerialTail(id, 10))
	require.NoError(t, b.Shutdown(ctx, id))
	running, err := b.Running(ctx, id)
	require.NoError(t, err)
	assert.False(t, running)
	t.Logf("serial after shutdown:\n%s", b.SerialTail(id, 5))
}
