package qemu

import (
	"strconv"
	"strings"
)

// args is the QEMU command line that runs vm under accel: every device the
// guest gets is named here, and QEMU is daemonized with its pidfile, QMP
// socket and own log in the VM's directory.
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

// optEscape escapes a value for QEMU's comma-separated option syntax.
func optEscape(s string) string { return strings.ReplaceAll(s, ",", ",,") }
