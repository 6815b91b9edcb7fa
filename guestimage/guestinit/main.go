//go:build linux

// Command guestinit is PID 1 of eitri's test guest: a tiny image whose only
// job is to prove, over the network, that a VM booted with the seed it was
// given. It loads the few drivers it needs, reads its NoCloud seed, leases an
// address with busybox udhcpc, then serves its identity over HTTP on port 80
// (and name lookups through its DHCP resolver, /resolve?name=; CPU load on
// demand, /burn?seconds=), echoes UDP on port 7, greets like sshd on port
// 22, and phones home when its seed asks, as cloud-init would. The ACPI
// power button powers it off.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

const (
	netIface  = "eth0"
	httpAddr  = ":80"
	echoAddr  = ":7"
	sshAddr   = ":22"
	readyWord = "EITRI-GUEST-READY"
)

func main() {
	// The console is the only place anyone can read what went wrong.
	slog.SetDefault(slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{Level: slog.LevelInfo})))
	if os.Getpid() != 1 {
		slog.Error("guestinit must run as PID 1")
		os.Exit(1)
	}
	if err := run(context.Background()); err != nil {
		slog.Error("guestinit failed", "err", err)
	}
	// Never return: PID 1 exiting panics the kernel. Power off instead, so a
	// broken guest ends its QEMU process rather than hanging it.
	powerOff("init failed")
}

func run(ctx context.Context) error {
	if err := mountBasics(); err != nil {
		return err
	}
	go reapChildren()
	go watchSignals()

	loadModules("/lib/modules/order")
	go watchPowerButton()

	id := readSeed(ctx, 30*time.Second)
	if err := unix.Sethostname([]byte(id.Hostname)); err != nil {
		slog.Warn("set hostname", "err", err)
	}
	slog.Info("identity", "hostname", id.Hostname, "instance_id", id.InstanceID, "seed", id.Source)

	if err := bringUpLoopback(); err != nil {
		slog.Warn("loopback", "err", err)
	}
	// Listen before asking for an address, so the ready line can promise that
	// both servers already accept.
	if err := startServers(id); err != nil {
		return err
	}
	addr, err := leaseAddress(ctx, netIface)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stdout, "%s ip=%s hostname=%s\n", readyWord, addr, id.Hostname)
	if id.PhoneHomeURL != "" {
		go phoneHome(ctx, id)
	}
	select {}
}

func mountBasics() error {
	mounts := []struct {
		src, dst, fstype string
		flags            uintptr
	}{
		{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC},
		{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC},
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID},
		{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV},
		{"tmpfs", "/tmp", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV},
	}
	for _, m := range mounts {
		if err := os.MkdirAll(m.dst, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, m.dst, m.fstype, m.flags, ""); err != nil && err != unix.EBUSY {
			return fmt.Errorf("mount %s: %w", m.dst, err)
		}
	}
	return nil
}

// reapChildren collects orphans re-parented to PID 1 (udhcpc's script
// helpers, mostly), which would otherwise pile up as zombies. Nothing else in
// this init waits on a child, so reaping everything steals no exit status.
func reapChildren() {
	for {
		var ws unix.WaitStatus
		_, err := unix.Wait4(-1, &ws, 0, nil)
		if err == unix.ECHILD {
			time.Sleep(time.Second)
		}
	}
}
