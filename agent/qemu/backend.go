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
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sync"
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
