//go:build linux

package main

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"time"

	"golang.org/x/sys/unix"
)

// leaseAddress runs busybox udhcpc in the foreground of its own process,
// renewing for the guest's whole life, and returns once the interface holds
// an IPv4 address. The udhcpc script applies what the server offered.
func leaseAddress(ctx context.Context, iface string) (netip.Addr, error) {
	var ifc *net.Interface
	for i := 0; ; i++ {
		var err error
		if ifc, err = net.InterfaceByName(iface); err == nil {
			break
		}
		if i > 150 {
			return netip.Addr{}, fmt.Errorf("interface %s never appeared: %w", iface, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	cmd := exec.Command("/bin/udhcpc", "-f", "-i", iface, "-s", "/etc/udhcpc.script", "-t", "5", "-T", "2")
	cmd.Stdout, cmd.Stderr = os.Stdout, os.Stdout
	if err := cmd.Start(); err != nil {
		return netip.Addr{}, fmt.Errorf("start udhcpc: %w", err)
	}
	// cmd is never waited on: reapChildren collects it if it dies, and the
	// address it configured stays on the interface either way.
	for {
		if a, ok := ipv4Of(ifc); ok {
			return a, nil
		}
		select {
		case <-ctx.Done():
			return netip.Addr{}, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func ipv4Of(ifc *net.Interface) (netip.Addr, bool) {
	addrs, err := ifc.Addrs()
	if err != nil {
		return netip.Addr{}, false
	}
	for _, a := range addrs {
		p, err := netip.ParsePrefix(a.String())
		if err != nil {
			continue
		}
		if ip := p.Addr(); ip.Is4() && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() {
			return ip, true
		}
	}
	return netip.Addr{}, false
}

// bringUpLoopback sets lo up with an ioctl rather than running ip: reapChildren
// would race exec's own wait for the exit status.
func bringUpLoopback() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}
