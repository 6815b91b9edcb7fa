package qemu

import (
	"fmt"
	"os/exec"
)

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
