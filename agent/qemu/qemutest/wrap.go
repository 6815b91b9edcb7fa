package qemutest

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// Wrap stands in for QEMU: it writes a qemu-system-x86_64 into a temporary
// directory that sets $kvm when KVM is asked for and $vm for a VM start
// (-daemonize; a probe runs in the foreground), appends its command line to
// the calls file, runs body (shell), then the real QEMU with the arguments
// as body left them. A host whose KVM misbehaves is played on any machine.
func Wrap(t *testing.T, body string) (bin, calls string) {
	t.Helper()
	real, err := exec.LookPath("qemu-system-x86_64")
	require.NoError(t, err)
	dir := t.TempDir()
	bin, calls = filepath.Join(dir, "qemu-system-x86_64"), filepath.Join(dir, "calls")
	script := `#!/bin/sh
kvm= vm=
for a in "$@"; do
	case "$a" in
	*accel=kvm*) kvm=1 ;;
	-daemonize) vm=1 ;;
	esac
done
echo "$*" >>` + calls + `
` + body + `
exec ` + real + ` "$@"
`
	require.NoError(t, os.WriteFile(bin, []byte(script), 0o755))
	return bin, calls
}

// ProbesPassUnderKVM, as (part of) a Wrap body, makes accelerator probes
// "pass" under KVM on any machine: they run under TCG instead. VM starts
// are left alone.
const ProbesPassUnderKVM = `
if [ -n "$kvm" ] && [ -z "$vm" ]; then
	n=$#
	for a in "$@"; do
		case "$a" in
		q35,accel=kvm) a=q35,accel=tcg ;;
		host|qemu64) a=max ;;
		esac
		set -- "$@" "$a"
	done
	shift $n
fi`
