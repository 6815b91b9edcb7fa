package qemu

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// permanentError marks a failure that retrying on this host cannot fix
// (a missing hypervisor binary, an impossible VM spec). The reconcile engine
// looks for the Permanent method and fails the VM at once instead of
// spending its retry budget.
type permanentError struct{ err error }

func (e *permanentError) Error() string   { return e.err.Error() }
func (e *permanentError) Unwrap() error   { return e.err }
func (e *permanentError) Permanent() bool { return true }

func permanent(format string, args ...any) error {
	return &permanentError{err: fmt.Errorf(format, args...)}
}

// IsPermanent reports whether err (or anything it wraps) says it is permanent.
func IsPermanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}

const (
	defaultBinary    = "qemu-system-x86_64"
	defaultImgBinary = "qemu-img"
	tunDevice        = "/dev/net/tun"
	capNetAdmin      = 12 // linux/capability.h
)

// Requirements lists what this host lacks to run guests, one line per
// missing piece, each saying how to fix it. Empty means ready. A missing
// /dev/kvm is not listed: guests still run under TCG, only slower.
func Requirements() []string {
	return requirements(defaultBinary, defaultImgBinary, tunDevice, os.Geteuid(), readCapEff)
}

func requirements(binary, imgBinary, tun string, euid int, capEff func() (uint64, error)) []string {
	var missing []string
	if euid != 0 {
		caps, err := capEff()
		if err != nil || caps&(1<<capNetAdmin) == 0 {
			missing = append(missing, "not root and no CAP_NET_ADMIN: run the agent as root (or grant it CAP_NET_ADMIN, e.g. AmbientCapabilities=CAP_NET_ADMIN in its systemd unit) so it can manage the bridge, taps and NAT")
		}
	}
	if _, err := exec.LookPath(binary); err != nil {
		missing = append(missing, fmt.Sprintf("%s not found: apt-get install qemu-system-x86 (or dnf install qemu-kvm)", binary))
	}
	if _, err := exec.LookPath(imgBinary); err != nil {
		missing = append(missing, fmt.Sprintf("%s not found: apt-get install qemu-utils (or dnf install qemu-img)", imgBinary))
	}
	if fi, err := os.Stat(tun); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		missing = append(missing, fmt.Sprintf("%s missing: modprobe tun (in a container, pass the device through, e.g. --device /dev/net/tun)", tun))
	}
	return missing
}

// readCapEff returns this process's effective capability set.
func readCapEff() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "CapEff:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	return 0, errors.New("CapEff not found in /proc/self/status")
}
