// Package hostvm is the hypervisor the agent ships: it implements
// reconcile.Hypervisor with real QEMU guests (agent/qemu) on the host's guest
// network (agent/netsetup), and adapts the image cache and the seed writer to
// the engine's Images and Seeder.
//
// Where a VM's pieces live:
//   - root disk: <qemu dir>/<id>/root.qcow2, beside QEMU's pidfile, QMP socket
//     and serial log, so qemu.Backend.Destroy removes it with them;
//   - seed: wherever the engine puts it (state.Store.SeedPath), removed by
//     Destroy too;
//   - tap: netsetup.TapName(id); address: a netsetup lease keyed by the VM id
//     with MAC netsetup.MAC(id), so the guest's address is stable. The lease
//     also carries the VM's owner (state.VMSpec.Owner), which the bridge
//     filter uses to let only guests of one owner reach each other.
//
// A guest is ready when it is usable, not when it has an address (see
// readiness.go): cloud-init phoning home, else sshd answering, else, after
// a bounded wait, the address alone.
package hostvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"time"

	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/permanent"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/reconcile"
	"github.com/a73x/eitri/agent/state"
)

const (
	rootDiskName = "root.qcow2"

	// DefaultAddressWait bounds how long Boot waits for the guest's DHCP
	// lease when the caller's context allows longer. Generous: a full cloud
	// image under TCG can take minutes to reach DHCP.
	DefaultAddressWait = 5 * time.Minute
	// DefaultSerialLines is how much of the serial console a boot error
	// carries.
	DefaultSerialLines = 20

	leasePoll = 200 * time.Millisecond
)

var _ reconcile.Hypervisor = (*Hypervisor)(nil)

// Config wires a Hypervisor. QEMU, Net and St are required.
type Config struct {
	QEMU *qemu.Backend
	Net  *netsetup.Network
	// St says where the engine keeps seeds, so Destroy can remove them.
	St *state.Store
	// Images, when set, is the adapter the engine resolves images through;
	// PrepareRootDisk drops the pin it took once the root disk holds the base.
	Images *Images
	// AddressWait bounds Boot's wait for the guest's first lease (default
	// DefaultAddressWait). The caller's context may end the wait earlier.
	AddressWait time.Duration
	// SerialLines is how many serial console lines a boot error carries
	// (default DefaultSerialLines).
	SerialLines int
	// SSHFallbackAfter is how long after its start a guest has to phone
	// home before sshd answering on port 22 makes it ready instead (default
	// DefaultSSHFallbackAfter). ReadyWait is when an address alone does
	// (default DefaultReadyWait).
	SSHFallbackAfter time.Duration
	ReadyWait        time.Duration
	Log              *slog.Logger
}

// Hypervisor runs guests as QEMU processes on the host guest network.
type Hypervisor struct {
	qemu        *qemu.Backend
	net         *netsetup.Network
	st          *state.Store
	images      *Images
	addressWait time.Duration
	serialLines int
	sshAfter    time.Duration
	readyWait   time.Duration
	sshPort     uint16 // 22; tests probe their own listener
	log         *slog.Logger

	mu sync.Mutex
	// known holds VMs this process has booted or looked for a QEMU of; any
	// other VM is checked for a QEMU left by an earlier agent before its
	// power is trusted.
	known map[string]bool
	// ready remembers, per VM, the boot found ready and by what; probed
	// when its port 22 was last tried.
	ready  map[string]readyMark
	probed map[string]time.Time
}

// New builds a Hypervisor over set-up building blocks.
func New(cfg Config) (*Hypervisor, error) {
	if cfg.QEMU == nil || cfg.Net == nil || cfg.St == nil {
		return nil, errors.New("hostvm: QEMU, Net and St are required")
	}
	if cfg.AddressWait <= 0 {
		cfg.AddressWait = DefaultAddressWait
	}
	if cfg.SerialLines <= 0 {
		cfg.SerialLines = DefaultSerialLines
	}
	if cfg.SSHFallbackAfter <= 0 {
		cfg.SSHFallbackAfter = DefaultSSHFallbackAfter
	}
	if cfg.ReadyWait <= 0 {
		cfg.ReadyWait = max(DefaultReadyWait, cfg.SSHFallbackAfter)
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Hypervisor{
		qemu:        cfg.QEMU,
		net:         cfg.Net,
		st:          cfg.St,
		images:      cfg.Images,
		addressWait: cfg.AddressWait,
		serialLines: cfg.SerialLines,
		sshAfter:    cfg.SSHFallbackAfter,
		readyWait:   cfg.ReadyWait,
		sshPort:     22,
		log:         cfg.Log.With("component", "hostvm"),
		known:       map[string]bool{},
		ready:       map[string]readyMark{},
		probed:      map[string]time.Time{},
	}, nil
}

// RootDisk is where the VM's root disk lives: inside QEMU's per-VM directory,
// so destroying the VM removes it.
func (h *Hypervisor) RootDisk(id string) string {
	return filepath.Join(h.qemu.VMDir(id), rootDiskName)
}

// Preflight refuses, permanently, a VM this host can never run: no QEMU, no
// tun device, or a spec beyond the host's CPUs or memory.
func (h *Hypervisor) Preflight(ctx context.Context, spec state.VMSpec) error {
	if err := h.qemu.Preflight(); err != nil {
		return err
	}
	if fi, err := os.Stat("/dev/net/tun"); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		return permanent.Errorf("hostvm: /dev/net/tun is missing: modprobe tun (in a container, pass the device through)")
	}
	return checkSpec(spec, int32(runtime.NumCPU()), hostMemMB)
}

// checkSpec validates a spec against the host's size. hostMem is asked lazily
// so a spec that is already wrong never reads /proc.
func checkSpec(spec state.VMSpec, hostCPUs int32, hostMem func() (int64, error)) error {
	switch {
	case spec.VCPUs <= 0:
		return permanent.Errorf("hostvm: vm %s: vcpus must be positive, got %d", spec.ID, spec.VCPUs)
	case spec.MemMB <= 0:
		return permanent.Errorf("hostvm: vm %s: memory must be positive, got %d MiB", spec.ID, spec.MemMB)
	case spec.DiskGB <= 0:
		return permanent.Errorf("hostvm: vm %s: disk must be positive, got %d GiB", spec.ID, spec.DiskGB)
	case spec.VCPUs > hostCPUs:
		return permanent.Errorf("hostvm: vm %s wants %d vcpus; this host has %d CPUs", spec.ID, spec.VCPUs, hostCPUs)
	}
	total, err := hostMem()
	if err != nil {
		// Not knowing the host's memory is no reason to refuse a VM.
		return nil
	}
	if spec.MemMB > total {
		return permanent.Errorf("hostvm: vm %s wants %d MiB of memory; this host has %d MiB", spec.ID, spec.MemMB, total)
	}
	return nil
}

// PrepareRootDisk makes the VM's root disk: a qcow2 overlay of base sized to
// the spec. An existing disk is kept. The overlay keeps its base alive with a
// hard link, so the cache pin the engine took with Images.Resolve may go once
// this returns.
func (h *Hypervisor) PrepareRootDisk(ctx context.Context, spec state.VMSpec, basePath string) error {
	dst := h.RootDisk(spec.ID)
	err := h.qemu.PrepareRootDisk(ctx, dst, basePath, spec.DiskGB)
	if h.images != nil {
		// Without the hard link (cache and VM dirs on different filesystems)
		// the overlay reads the cache's file itself: keep the pin, which lasts
		// only while this agent runs, and say so.
		if _, linkErr := os.Stat(dst + ".base"); err == nil && linkErr != nil {
			h.log.Warn("root disk references the cached image directly (cache on another filesystem?); it stays pinned only until the agent restarts",
				"vm", spec.ID, "base", basePath)
			h.images.keep(spec.ImageSHA256)
		}
	}
	return err
}

// Boot starts the VM's QEMU (a no-op if it is already running) on its tap
// with its root disk and seed, then waits until the guest has accepted its
// address over DHCP, and then until it is ready (Ready), narrating what it
// waits for with the address already known.
//
// The wait for the address makes a boot that never comes up an error
// carrying the serial console's last lines, which the engine records as
// last_error:
//   - the caller's ctx ends first (the engine's per-pass VMTimeout, or
//     shutdown): the error wraps ctx's error and QEMU keeps running, so a
//     slow guest keeps booting and the next attempt picks it up;
//   - AddressWait passes first, or QEMU exits: the guest is killed so a
//     retry boots it afresh and a failed VM holds no QEMU;
//   - KVM stops the guest: the guest is killed, the host moves to its next
//     accelerator, and the error (a *qemu.AccelError) tells the engine the
//     attempt was the host's fault, so the retry costs the VM nothing.
func (h *Hypervisor) Boot(ctx context.Context, spec state.VMSpec, seedPath string) error {
	id := spec.ID
	mac, tap := netsetup.MAC(id), netsetup.TapName(id)
	if err := h.plug(id, spec.Owner); err != nil {
		return err
	}
	vm := qemu.VM{
		ID:       id,
		VCPUs:    int(spec.VCPUs),
		MemMB:    spec.MemMB,
		DiskGB:   spec.DiskGB,
		RootDisk: h.RootDisk(id),
		SeedISO:  seedPath,
		Tap:      tap,
		MAC:      mac,
	}
	err := h.qemu.Start(ctx, vm)
	h.markKnown(id)
	if err != nil {
		return err // a QEMU that died at once already says why, serial included
	}
	reconcile.Narrate(ctx, reconcile.SayWaitingForAddress)
	addr, err := h.waitAddress(ctx, id)
	if err != nil {
		return err
	}
	return h.waitReady(ctx, id, addr, spec.Readiness)
}

func (h *Hypervisor) waitAddress(ctx context.Context, id string) (netip.Addr, error) {
	start := time.Now()
	deadline := time.NewTimer(h.addressWait)
	defer deadline.Stop()
	tick := time.NewTicker(leasePoll)
	defer tick.Stop()
	for {
		if addr, ok := h.leased(id); ok {
			h.log.Info("guest took its address", "vm", id, "addr", addr, "after", time.Since(start).Round(time.Millisecond))
			return addr, nil
		}
		// Before the exit check: a QEMU that KVM killed is the host's
		// fault, not the guest's.
		if err := h.qemu.CheckAccel(ctx, id); err != nil {
			return netip.Addr{}, fmt.Errorf("hostvm: vm %s: %w", id, err)
		}
		if _, ok := h.qemu.PID(id); !ok {
			return netip.Addr{}, fmt.Errorf("hostvm: vm %s: QEMU exited before the guest took an address%s", id, h.tail(id))
		}
		select {
		case <-ctx.Done():
			return netip.Addr{}, fmt.Errorf("hostvm: vm %s: no address yet after %s: %w%s",
				id, time.Since(start).Round(time.Second), ctx.Err(), h.tail(id))
		case <-deadline.C:
			err := fmt.Errorf("hostvm: vm %s: the guest took no address within %s%s", id, h.addressWait, h.tail(id))
			if kerr := h.qemu.Kill(ctx, id); kerr != nil {
				err = errors.Join(err, kerr)
			}
			return netip.Addr{}, err
		case <-tick.C:
		}
	}
}

// tail formats the serial console's last lines as an error suffix.
func (h *Hypervisor) tail(id string) string {
	t := h.SerialTail(id)
	if t == "" {
		return " (the serial console is empty)"
	}
	return "; serial console:\n" + t
}

// SerialTail is the last lines of the VM's serial console ("" if none).
func (h *Hypervisor) SerialTail(id string) string {
	return h.qemu.SerialTail(id, h.serialLines)
}

// Shutdown powers the guest off (ACPI, then quit, then kill), and says so
// when it has to force it.
func (h *Hypervisor) Shutdown(ctx context.Context, id string) error {
	return h.qemu.ShutdownWith(ctx, id, func(grace time.Duration) {
		reconcile.Narrate(ctx, "forcing off after "+durationWords(grace))
	})
}

// durationWords says a grace period as people read it: "30 s", "2 min".
func durationWords(d time.Duration) string {
	if d >= time.Minute && d%time.Minute == 0 {
		return fmt.Sprintf("%d min", d/time.Minute)
	}
	return fmt.Sprintf("%d s", (d+time.Second-1)/time.Second)
}

// Exited reports, once, that the VM's QEMU ended without being asked to,
// with how it ended and its serial console's last lines (the log of that
// boot is kept beside the next one's as serial.log.1).
func (h *Hypervisor) Exited(ctx context.Context, id string) (reconcile.GuestExit, bool) {
	if !h.isKnown(id) {
		// A QEMU an earlier agent left is adopted first: a running one is
		// no exit.
		if err := h.adopt(ctx, id); err != nil {
			return reconcile.GuestExit{}, false
		}
	}
	x, ok := h.qemu.Exited(id)
	if !ok {
		return reconcile.GuestExit{}, false
	}
	return reconcile.GuestExit{Reason: x.Reason(), SerialTail: x.SerialTail}, true
}

// Power says whether the guest runs. The first question about a VM this
// process did not boot adopts a QEMU an earlier agent left running, so a
// restarted agent finds its guests running and never boots them again.
func (h *Hypervisor) Power(ctx context.Context, id string) (bool, error) {
	if !h.isKnown(id) {
		if err := h.adopt(ctx, id); err != nil {
			return false, err
		}
	}
	return h.qemu.Running(ctx, id)
}

// adopt takes over the QEMU an earlier agent left running for this VM, on
// first sight of it (Power, Exited), and puts its network back in place (tap
// on the bridge, address reserved). A VM with no QEMU is fine; a QEMU that
// does not answer is an error, and that VM is tried again next time.
func (h *Hypervisor) adopt(ctx context.Context, id string) error {
	running, err := h.qemu.Adopt(ctx, id)
	if err != nil {
		return err
	}
	if running {
		// Idempotent; it matters when the bridge, the lease file or the
		// guest filter was rebuilt while the agent was down. A VM without a
		// record has no owner: isolated.
		rec, _, err := h.st.LoadVM(id)
		if err != nil {
			h.log.Warn("adopted vm: cannot read its record; its network stays as it is", "vm", id, "err", err)
		} else if err := h.plug(id, rec.Spec.Owner); err != nil {
			h.log.Warn("adopted vm: cannot restore its network", "vm", id, "err", err)
		}
	}
	h.markKnown(id)
	return nil
}

// plug gives the VM its place on the guest network: its address reserved
// under its owner, its tap on the bridge, the bridge filter written for both.
func (h *Hypervisor) plug(id, owner string) error {
	if _, err := h.net.Allocate(id, netsetup.MAC(id), owner); err != nil {
		return fmt.Errorf("hostvm: vm %s: address: %w", id, err)
	}
	if err := h.net.AddTap(netsetup.TapName(id)); err != nil {
		return fmt.Errorf("hostvm: vm %s: %w", id, err)
	}
	return nil
}

// SetOwner moves a VM to another owner: which guests it may reach changes
// at once, running or not. A VM that holds no address yet takes the owner
// at its next Boot.
func (h *Hypervisor) SetOwner(ctx context.Context, id, owner string) error {
	if err := h.net.SetOwner(id, owner); err != nil {
		return fmt.Errorf("hostvm: vm %s: owner: %w", id, err)
	}
	return nil
}

func (h *Hypervisor) isKnown(id string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.known[id]
}

func (h *Hypervisor) markKnown(id string) {
	h.mu.Lock()
	h.known[id] = true
	h.mu.Unlock()
}

// Address is the guest's address once it has accepted it over DHCP in its
// current boot.
func (h *Hypervisor) Address(ctx context.Context, id string) (netip.Addr, bool) {
	return h.leased(id)
}

// leased counts only an ACK given after the running QEMU started: a lease
// from an earlier boot says nothing about whether this boot has come up, and
// "ready" promises a guest that has.
func (h *Hypervisor) leased(id string) (netip.Addr, bool) {
	addr, at, ok := h.net.LeasedAt(id)
	if !ok {
		return netip.Addr{}, false
	}
	started, running := h.qemu.StartedAt(id)
	if !running || at.Before(started) {
		return netip.Addr{}, false
	}
	return addr, true
}

// Destroy removes everything the VM holds on this host: QEMU, its directory
// (root disk, logs, sockets), the seed, the tap and the address. Each part is
// attempted even when another fails; any failure is returned so the engine
// tries again.
func (h *Hypervisor) Destroy(ctx context.Context, id string) error {
	if !state.ValidID(id) {
		return permanent.Errorf("hostvm: invalid vm id %q", id)
	}
	qerr := h.qemu.Destroy(ctx, id)
	var errs []error
	errs = append(errs, qerr)
	if qerr == nil {
		// Only once QEMU is gone: it holds the tap and the seed open.
		if err := os.RemoveAll(filepath.Dir(h.st.SeedPath(id))); err != nil {
			errs = append(errs, fmt.Errorf("hostvm: remove seed: %w", err))
		}
		errs = append(errs, h.net.RemoveTap(netsetup.TapName(id)))
		errs = append(errs, h.net.Release(id))
	}
	h.mu.Lock()
	delete(h.known, id)
	delete(h.ready, id)
	delete(h.probed, id)
	h.mu.Unlock()
	return errors.Join(errs...)
}
