// Package qemutest holds guests for tests of the QEMU backend and the code
// that drives it. It is imported by tests only.
package qemutest

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// MMIODisk writes a guest KVM cannot run and returns its path: its MBR
// enters 32-bit protected mode and jumps into the IOAPIC's MMIO window
// (0xFEC00000), where there is no memory to fetch instructions from. KVM
// gives up with "KVM internal error. Suberror: 1 ... emulation failure" and
// QEMU pauses the guest in status internal-error, as on hosts whose KVM
// breaks in the firmware. Under TCG it just spins.
func MMIODisk(t *testing.T) string {
	t.Helper()
	code := []byte{
		0xFA,       // cli
		0x31, 0xC0, // xor ax, ax
		0x8E, 0xD8, // mov ds, ax
		0x0F, 0x01, 0x16, 0x00, 0x00, // lgdt [gdtr] (address patched below)
		0x0F, 0x20, 0xC0, // mov eax, cr0
		0x0C, 0x01, // or al, 1: protection on
		0x0F, 0x22, 0xC0, // mov cr0, eax
		0x66, 0xEA, 0x00, 0x00, 0xC0, 0xFE, 0x08, 0x00, // jmp dword 0x08:0xFEC00000
	}
	mbr := make([]byte, 512)
	copy(mbr, code)
	// GDT at 32: a null descriptor, then a flat 4 GiB 32-bit code segment.
	copy(mbr[32:], []byte{0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0, 0, 0, 0x9A, 0xCF, 0})
	// GDTR at 48: limit, base.
	binary.LittleEndian.PutUint16(mbr[48:], 15)
	binary.LittleEndian.PutUint32(mbr[50:], 0x7C00+32)
	binary.LittleEndian.PutUint16(mbr[8:], 0x7C00+48)
	mbr[510], mbr[511] = 0x55, 0xAA
	path := filepath.Join(t.TempDir(), "mmio.raw")
	require.NoError(t, os.WriteFile(path, mbr, 0o600))
	require.NoError(t, os.Truncate(path, 1<<20))
	return path
}
