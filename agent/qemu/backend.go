// Package qemu is the agent's hypervisor backend: it prepares root disks and
// runs each VM as a daemonized qemu-system-x86_64 process supervised over
// QMP. The QEMU process belongs to the host, not to the agent: it outlives an
// agent restart and the next agent adopts it again from its state directory.
//
// Guests run under KVM only where a probe guest has proved KVM runs what
// guests do (see Backend.Probe), else under TCG; a KVM failure a real VM
// meets later moves the host down the same list.
package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/a73x/eitri/agent/permanent"
)

const (
	pidFileName    = "qemu.pid"
	qmpSockName    = "qmp.sock"
	serialFileName = "serial.log"
	// logFileName is QEMU's own stderr (-D): after -daemonize it is the only
	// place a KVM failure or an assertion is written.
	logFileName = "qemu.log"
	// probeDirPrefix names the accelerator probe's scratch directories in
	// Dir; the dot keeps them apart from VM directories (see validID).
	probeDirPrefix = ".probe-"

	defaultShutdownGrace = 30 * time.Second
	// quitGrace is how long QEMU gets to exit after QMP quit before SIGKILL.
	quitGrace = 5 * time.Second
	// maxUnixPath is sun_path's size minus the terminating NUL.
	maxUnixPath = 107
)

// Config configures a Backend.
type Config struct {
	// Dir is the root of the per-VM state directories (Dir/<vm id>/).
	Dir string
	// Binary and ImgBinary default to qemu-system-x86_64 and qemu-img on PATH.
	Binary, ImgBinary string
	Log               *slog.Logger
	// ShutdownGrace is how long a guest gets to power off after the ACPI
	// power button before QEMU is told to quit. Default 30s.
	ShutdownGrace time.Duration
	// Accel is how the accelerator is chosen (default AccelAuto).
	Accel AccelMode
	// OnAccelChange, if set, is called with each probe result that differs
	// from the one before (the first included), from the goroutine that
	// probed; probes never overlap, so calls never do.
	OnAccelChange func(Accel)
	// SerialLogMax bounds the disk a running guest's serial log takes: it
	// is cut back to its newest bytes as it grows (seriallog.go). Default
	// DefaultSerialLogMax.
	SerialLogMax int64
}

// VM is what the backend needs to run one guest.
type VM struct {
	ID     string
	VCPUs  int
	MemMB  int64
	DiskGB int64
	// RootDisk is the boot disk (normally the overlay PrepareRootDisk made);
	// SeedISO, when set, is attached read-only as a second disk.
	RootDisk, SeedISO string
	// Tap is the host tap device for the guest's NIC; empty means no NIC.
	Tap string
	MAC net.HardwareAddr
}

// Backend runs VMs as QEMU processes.
type Backend struct {
	cfg Config
	log *slog.Logger

	mu    sync.Mutex
	locks map[string]*vmLocks
	// watched holds the pid of each QEMU this Backend started or adopted
	// and has not been asked to end (see Exited).
	watched map[string]int

	// probeMu serializes probes: a second caller waits for the first's
	// verdict instead of booting another probe guest.
	probeMu sync.Mutex
	// accelMu guards the fields below.
	accelMu  sync.Mutex
	accel    Accel
	probeErr error
	probed   bool // accel and probeErr hold a verdict Start may use
	// demoted are candidates that passed a probe but then failed a real VM;
	// probes skip them for the life of this Backend.
	demoted []probeFailure
	// launched is the accelerator of each QEMU this Backend started, so a
	// KVM failure can be blamed on the right candidate after QEMU is gone.
	launched map[string]Accel
	// serial holds the open console input connections (console.go).
	serial serialConns
	// copies holds the copies of serial output into the logs (seriallog.go).
	copies serialCopies

	// Probe bounds and the KVM device, fields so tests can change them.
	kvmProbeTimeout, tcgProbeTimeout time.Duration
	kvmDevice                        string
}

// vmLocks serializes work on one VM inside this process. Lifecycle changes
// (start, shutdown, kill, destroy) exclude each other; QMP sessions are
// serialized separately so Running answers while a shutdown is waiting.
type vmLocks struct {
	life sync.Mutex
	qmp  sync.Mutex
}

// New makes a Backend rooted at cfg.Dir. A missing QEMU binary is not an
// error here, so the agent can start and report it; operations that need the
// binary fail with a permanent error instead.
func New(cfg Config) (*Backend, error) {
	if cfg.Dir == "" {
		return nil, errors.New("qemu: Config.Dir is required")
	}
	dir, err := filepath.Abs(cfg.Dir)
	if err != nil {
		return nil, fmt.Errorf("qemu: state dir: %w", err)
	}
	cfg.Dir = dir
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("qemu: state dir: %w", err)
	}
	if cfg.Binary == "" {
		cfg.Binary = defaultBinary
	}
	if cfg.ImgBinary == "" {
		cfg.ImgBinary = defaultImgBinary
	}
	if cfg.ShutdownGrace <= 0 {
		cfg.ShutdownGrace = defaultShutdownGrace
	}
	if cfg.SerialLogMax <= 0 {
		cfg.SerialLogMax = DefaultSerialLogMax
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	mode, err := ParseAccelMode(string(cfg.Accel))
	if err != nil {
		return nil, fmt.Errorf("qemu: %w", err)
	}
	cfg.Accel = mode
	removeStaleProbes(cfg.Dir)
	if err := becomeSubreaper(); err != nil {
		cfg.Log.Warn("qemu: cannot become a child subreaper; a guest's exit status will read unknown", "err", err)
	}
	return &Backend{
		cfg: cfg, log: cfg.Log.With("component", "qemu"), locks: map[string]*vmLocks{}, watched: map[string]int{},
		launched:        map[string]Accel{},
		kvmProbeTimeout: defaultKVMProbeTimeout, tcgProbeTimeout: defaultTCGProbeTimeout,
		kvmDevice: kvmDevice,
	}, nil
}

// removeStaleProbes removes scratch left by a probe whose agent died
// mid-probe. Only old scratch: another Backend over the same directory (a
// test, a tool) may be probing right now, and no probe lasts this long.
func removeStaleProbes(dir string) {
	stale, err := filepath.Glob(filepath.Join(dir, probeDirPrefix+"*"))
	if err != nil {
		return
	}
	for _, d := range stale {
		if fi, err := os.Stat(d); err == nil && time.Since(fi.ModTime()) > 10*time.Minute {
			_ = os.RemoveAll(d)
		}
	}
}

// Preflight fails permanently when this host can never run a guest, so a
// create can stop before downloading anything: no QEMU, or a probe that
// found no accelerator the mode allows.
func (b *Backend) Preflight() error {
	if _, err := b.binary(); err != nil {
		return err
	}
	if _, err := b.imgBinary(); err != nil {
		return err
	}
	_, err, _ := b.recorded()
	return err
}

// VMDir is the state directory of one VM. Put the VM's root disk and seed
// here so Destroy removes them with everything else.
func (b *Backend) VMDir(id string) string { return filepath.Join(b.cfg.Dir, id) }

func (b *Backend) binary() (string, error) {
	p, err := exec.LookPath(b.cfg.Binary)
	if err != nil {
		return "", permanent.Errorf("%s not found: apt-get install qemu-system-x86", b.cfg.Binary)
	}
	return p, nil
}

func (b *Backend) imgBinary() (string, error) {
	p, err := exec.LookPath(b.cfg.ImgBinary)
	if err != nil {
		return "", permanent.Errorf("%s not found: apt-get install qemu-utils", b.cfg.ImgBinary)
	}
	return p, nil
}

func (b *Backend) lock(id string) *vmLocks {
	b.mu.Lock()
	defer b.mu.Unlock()
	l, ok := b.locks[id]
	if !ok {
		l = &vmLocks{}
		b.locks[id] = l
	}
	return l
}

var validID = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// ValidID reports whether QEMU can run a VM of this id: it must be usable as
// a single path component and a QEMU option value. state.ValidID is the same
// rule.
func ValidID(id string) bool { return validID.MatchString(id) }

func checkID(id string) error {
	if !ValidID(id) {
		return permanent.Errorf("qemu: invalid vm id %q", id)
	}
	return nil
}

func (b *Backend) pidPath(id string) string  { return filepath.Join(b.VMDir(id), pidFileName) }
func (b *Backend) sockPath(id string) string { return filepath.Join(b.VMDir(id), qmpSockName) }
func (b *Backend) serialPath(id string) string {
	return filepath.Join(b.VMDir(id), serialFileName)
}
func (b *Backend) logPath(id string) string { return filepath.Join(b.VMDir(id), logFileName) }

// optEscape escapes a value for QEMU's comma-separated option syntax.
func optEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }

// PrepareRootDisk makes dst a qcow2 overlay of the raw base image with a
// virtual size of sizeGB GiB.
//
// An overlay rather than a copy or reflink: creating it costs the same for a
// 2 GiB and a 200 GiB base and works on any filesystem (reflinks need btrfs or
// XFS), the base stays shared and untouched, and the guest's writes land only
// in the overlay. The price is that the base must not change while overlays
// use it; to keep an image cache's eviction from pulling it away, dst pins the
// base with a hard link beside it (dst + ".base") when both are on one
// filesystem.
//
// An existing dst is kept as is: it may already hold a guest's data. One
// that is not a qcow2 image at all (an empty or torn file a power loss left
// by an older agent) holds nothing and is made again: booted, it would be
// taken for a blank raw disk. A new overlay is on disk (file and directory
// synced) before PrepareRootDisk returns, so its existence can be trusted.
func (b *Backend) PrepareRootDisk(ctx context.Context, dst, base string, sizeGB int64) error {
	if sizeGB <= 0 {
		return permanent.Errorf("qemu: root disk size must be positive, got %d GiB", sizeGB)
	}
	img, err := b.imgBinary()
	if err != nil {
		return err
	}
	if _, err := os.Stat(dst); err == nil {
		if format, ferr := diskFormat(dst); ferr == nil && format == "qcow2" {
			b.log.Debug("root disk exists, keeping it", "path", dst)
			return nil
		}
		b.log.Warn("root disk exists but is no qcow2 image (torn by a crash?); making it again", "path", dst)
		if err := os.Remove(dst); err != nil {
			return fmt.Errorf("qemu: root disk: %w", err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("qemu: root disk: %w", err)
	}
	base, err = filepath.Abs(base)
	if err != nil {
		return fmt.Errorf("qemu: base image: %w", err)
	}
	fi, err := os.Stat(base)
	if err != nil {
		return fmt.Errorf("qemu: base image: %w", err)
	}
	size := sizeGB << 30
	if fi.Size() > size {
		return permanent.Errorf("qemu: disk of %d GiB is smaller than the image (%d bytes)", sizeGB, fi.Size())
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
		return fmt.Errorf("qemu: root disk dir: %w", err)
	}
	dst, err = filepath.Abs(dst)
	if err != nil {
		return fmt.Errorf("qemu: root disk: %w", err)
	}

	backing := base
	pin := dst + ".base"
	_ = os.Remove(pin)
	if err := os.Link(base, pin); err == nil {
		backing = pin
	} else {
		b.log.Debug("cannot pin base image with a hard link; overlay references it directly", "base", base, "err", err)
	}

	tmp := dst + ".tmp"
	_ = os.Remove(tmp)
	cmd := exec.CommandContext(ctx, img, "create", "-q", "-f", "qcow2", "-F", "raw", "-b", backing, tmp, strconv.FormatInt(size, 10))
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.Remove(tmp)
		if backing == pin {
			_ = os.Remove(pin)
		}
		return fmt.Errorf("qemu-img create: %w: %s", err, bytes.TrimSpace(out))
	}
	// qemu-img does not sync what it writes: without this a power loss
	// could leave a dst that exists but is empty.
	if err := syncPath(tmp); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("qemu: root disk: %w", err)
	}
	if err := os.Rename(tmp, dst); err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("qemu: root disk: %w", err)
	}
	// The rename and the pin's link are entries of one directory.
	if err := syncPath(filepath.Dir(dst)); err != nil {
		return fmt.Errorf("qemu: root disk: %w", err)
	}
	b.log.Debug("root disk prepared", "path", dst, "base", base, "size_gb", sizeGB)
	return nil
}

// fsync is (*os.File).Sync; a test swaps it to see what is synced.
var fsync = (*os.File).Sync

// syncPath flushes a file, or a directory's entries, to disk.
func syncPath(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return fsync(f)
}

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
	reapDaemonizeParents()
	// QEMU has opened the pipe, or never will: reading it now ends at once
	// when it is gone.
	b.runSerial(vm.ID, capture)
	if err != nil {
		text := strings.TrimSpace(string(out) + "\n" + b.qemuLog(vm.ID))
		return kvmFault(text, fmt.Errorf("qemu: start vm %s: %w: %s", vm.ID, err, text))
	}
	pid, ok := b.alive(vm.ID)
	if !ok {
		b.settleSerial(vm.ID)
		logText, serial := b.qemuLog(vm.ID), b.SerialTail(vm.ID, 20)
		return kvmFault(logText+"\n"+serial,
			fmt.Errorf("qemu: vm %s exited right after start: %s", vm.ID, strings.TrimSpace(logText+"\n"+serial)))
	}
	st, err := b.status(ctx, vm.ID)
	if err != nil {
		// Half-started is worse than not started: the caller retries Start.
		_ = syscall.Kill(pid, syscall.SIGKILL)
		return fmt.Errorf("qemu: vm %s started but QMP does not answer: %w", vm.ID, err)
	}
	if kvm && st.Status == statusInternalError {
		cause := b.internalErrorCause(vm.ID)
		if err := b.killLocked(ctx, vm.ID, pid); err != nil {
			return err
		}
		return &kvmStartFault{cause: cause, err: fmt.Errorf("qemu: vm %s stopped at start: %s", vm.ID, cause)}
	}
	b.watch(vm.ID, pid)
	b.log.Info("vm started", "id", vm.ID, "pid", pid, "accel", accel.Name, "cpu", accel.CPU, "vcpus", vm.VCPUs, "mem_mb", vm.MemMB, "tap", vm.Tap)
	return nil
}

func (b *Backend) args(vm VM, accel Accel, rootFormat string) []string {
	args := []string{"-name", "guest=" + vm.ID}
	args = append(args, machineArgs(accel)...)
	args = append(args,
		"-smp", strconv.Itoa(vm.VCPUs),
		"-m", strconv.FormatInt(vm.MemMB, 10)+"M",
		// No default devices (VGA, default NIC, monitor): everything the
		// guest gets is listed below.
		"-nodefaults", "-no-user-config",
		"-display", "none",
		"-rtc", "base=utc",
	)
	args = append(args, b.serialArgs(vm.ID)...)
	args = append(args,
		"-chardev", "socket,id=qmp,path="+optEscape(b.sockPath(vm.ID))+",server=on,wait=off",
		"-mon", "chardev=qmp,mode=control",
		// The pidfile argument also identifies the process as this VM's
		// QEMU when adopting it (see alive).
		"-pidfile", b.pidPath(vm.ID),
		"-daemonize",
		// Keeps QEMU's stderr after -daemonize (which would send it to
		// /dev/null): KVM failures are written there.
		"-D", b.logPath(vm.ID),
		"-drive", "if=none,id=root,format="+rootFormat+",discard=unmap,file="+optEscape(vm.RootDisk),
		"-device", "virtio-blk-pci,drive=root,bootindex=1",
	)
	if vm.SeedISO != "" {
		args = append(args,
			"-drive", "if=none,id=seed,format=raw,readonly=on,file="+optEscape(vm.SeedISO),
			"-device", "virtio-blk-pci,drive=seed")
	}
	// Guests generate SSH host keys and cloud-init secrets at first boot;
	// without an entropy source that can stall for minutes under TCG.
	args = append(args, "-device", "virtio-rng-pci")
	if vm.Tap != "" {
		args = append(args,
			"-netdev", "tap,id=net0,ifname="+optEscape(vm.Tap)+",script=no,downscript=no",
			"-device", "virtio-net-pci,netdev=net0,mac="+vm.MAC.String())
	} else {
		args = append(args, "-nic", "none")
	}
	return args
}

// diskFormat tells qcow2 from raw by the qcow2 magic, so QEMU never has to
// guess (guessing raw is refused for writable disks).
func diskFormat(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	magic := make([]byte, 4)
	if _, err := io.ReadFull(f, magic); err == nil && string(magic) == "QFI\xfb" {
		return "qcow2", nil
	}
	return "raw", nil
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
	return b.killLocked(ctx, id, pid)
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

// serialTailBytes bounds how much of the serial log SerialTail reads.
const serialTailBytes = 64 << 10

var ansiEscape = regexp.MustCompile(`\x1b(\[[0-9;?]*[ -/]*[@-~]|[@-Z\\-_])`)

// SerialTail returns the last lines of the VM's serial console, cleaned of
// terminal escapes and carriage returns, for explaining a failed boot.
// It is empty when there is no log.
func (b *Backend) SerialTail(id string, lines int) string {
	if checkID(id) != nil || lines <= 0 {
		return ""
	}
	return fileTail(b.serialPath(id), lines)
}

// qemuLogLines bounds how much of QEMU's own log explains a failure.
const qemuLogLines = 40

// qemuLog is the last lines QEMU wrote to its stderr (the -D log).
func (b *Backend) qemuLog(id string) string { return fileTail(b.logPath(id), qemuLogLines) }

func fileTail(path string, lines int) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(fi.Size()-serialTailBytes, 0)
	buf := make([]byte, fi.Size()-off)
	n, _ := f.ReadAt(buf, off)
	return tailLines(buf[:n], lines, off > 0)
}

func tailLines(buf []byte, lines int, truncated bool) string {
	text := ansiEscape.ReplaceAllString(string(buf), "")
	text = strings.ReplaceAll(text, "\r\n", "\n")
	text = strings.Map(func(r rune) rune {
		if r == '\n' || r == '\t' || (r >= ' ' && r != 0x7f) {
			return r
		}
		return -1
	}, text)
	all := strings.Split(strings.TrimRight(text, "\n"), "\n")
	if truncated && len(all) > 0 {
		all = all[1:] // the first line was cut by the read offset
	}
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return strings.Join(all, "\n")
}
