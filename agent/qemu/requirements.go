package qemu

import (
	"errors"
	"fmt"
	"os/exec"
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
)

// Requirements lists what this host lacks to run QEMU, one line per missing
// piece, each saying how to fix it. Empty means ready. A missing /dev/kvm is
// not listed: guests still run under TCG, only slower. What the network
// needs (CAP_NET_ADMIN, /dev/net/tun) is netsetup's to say.
func Requirements() []string {
	return requirements(defaultBinary, defaultImgBinary)
}

func requirements(binary, imgBinary string) []string {
	var missing []string
	if _, err := exec.LookPath(binary); err != nil {
		missing = append(missing, fmt.Sprintf("%s not found: apt-get install qemu-system-x86 (or dnf install qemu-kvm)", binary))
	}
	if _, err := exec.LookPath(imgBinary); err != nil {
		missing = append(missing, fmt.Sprintf("%s not found: apt-get install qemu-utils (or dnf install qemu-img)", imgBinary))
	}
	return missing
}
