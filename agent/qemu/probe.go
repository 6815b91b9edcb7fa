package qemu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	// probeMarker is the line the probe guest prints on COM1 once it runs.
	probeMarker = "EITRI-PROBE-OK"
	// probeDiskSize: SeaBIOS refuses a disk that is only one sector long
	// ("could not read the boot disk"); a small sparse disk boots.
	probeDiskSize = 1 << 20

	defaultKVMProbeTimeout = 15 * time.Second
	defaultTCGProbeTimeout = 60 * time.Second

	// probeOutputCap bounds what is kept of a probe's serial and stderr.
	probeOutputCap = 64 << 10
	// kvmErrorGrace lets QEMU finish writing a KVM error (the lines after
	// "KVM internal error" say which) before the probe is killed.
	kvmErrorGrace = 200 * time.Millisecond
)

// probeDisk is the boot sector of the probe guest: SeaBIOS loads it at
// 0x7C00 and jumps to it in 16-bit real mode. It goes where boot loaders
// and kernels go before it says anything, so the line on COM1 proves the
// firmware, the boot disk and the CPU model all run:
//   - into 32-bit protected mode, then through an IRET there, as boot
//     loaders do returning from their BIOS-call thunks (syslinux does):
//     hosts whose KVM emulates mode switches (nested, without unrestricted
//     guests) stop there with "KVM internal error", exactly as real guests
//     do, while a plain real-mode guest would pass;
//   - into 64-bit long mode with paging, where the kernel runs;
//   - then it writes probeMarker to COM1 (port 0x3F8) and halts.
func probeDisk() []byte {
	const org = 0x7C00
	var code []byte
	labels := map[string]int{}
	type fixup struct {
		at, size int
		label    string
	}
	var fixups []fixup
	op := func(b ...byte) { code = append(code, b...) }
	label := func(name string) { labels[name] = len(code) }
	// addr leaves room for the absolute address of a label, filled in last.
	addr := func(size int, name string) {
		fixups = append(fixups, fixup{len(code), size, name})
		code = append(code, make([]byte, size)...)
	}

	// 16-bit real mode.
	op(0xFA)             // cli: nothing is set up to take interrupts
	op(0x31, 0xC0)       // xor ax, ax
	op(0x8E, 0xD8)       // mov ds, ax
	op(0x8E, 0xC0)       // mov es, ax
	op(0x8E, 0xD0)       // mov ss, ax
	op(0xBC, 0x00, 0x7C) // mov sp, 0x7C00: the stack grows down from the code
	op(0xFC)             // cld: string instructions walk forward
	op(0x66, 0x0F, 0x01, 0x16)
	addr(2, "gdtr")      // lgdt [gdtr]
	op(0x0F, 0x20, 0xC0) // mov eax, cr0
	op(0x0C, 0x01)       // or al, 1: protection on
	op(0x0F, 0x22, 0xC0) // mov cr0, eax
	op(0x66, 0xEA)
	addr(4, "pm32")
	op(0x08, 0x00) // jmp dword 0x08:pm32

	// 32-bit protected mode.
	label("pm32")
	op(0x66, 0xB8, 0x10, 0x00) // mov ax, 0x10: the flat data segment
	op(0x8E, 0xD8)             // mov ds, ax
	op(0x8E, 0xC0)             // mov es, ax
	op(0x8E, 0xD0)             // mov ss, ax
	op(0x9C)                   // pushfd
	op(0x6A, 0x08)             // push 0x08: cs
	op(0x68)
	addr(4, "paging") // push paging: eip
	op(0xCF)          // iretd: "return" to paging
	label("paging")
	// Identity-map the first 2 MiB with one large page: PML4 at 0x1000,
	// PDPT at 0x2000, page directory at 0x3000.
	op(0xBF, 0x00, 0x10, 0x00, 0x00)                               // mov edi, 0x1000
	op(0x0F, 0x22, 0xDF)                                           // mov cr3, edi
	op(0x31, 0xC0)                                                 // xor eax, eax
	op(0xB9, 0x00, 0x0C, 0x00, 0x00)                               // mov ecx, 0xC00: three 4 KiB tables, in dwords
	op(0xF3, 0xAB)                                                 // rep stosd: zero them
	op(0xC7, 0x05, 0x00, 0x10, 0x00, 0x00, 0x03, 0x20, 0x00, 0x00) // mov dword [0x1000], 0x2003: PML4[0] = PDPT, present, writable
	op(0xC7, 0x05, 0x00, 0x20, 0x00, 0x00, 0x03, 0x30, 0x00, 0x00) // mov dword [0x2000], 0x3003: PDPT[0] = page directory
	op(0xC7, 0x05, 0x00, 0x30, 0x00, 0x00, 0x83, 0x00, 0x00, 0x00) // mov dword [0x3000], 0x83: PD[0] = the 2 MiB page at 0
	op(0x0F, 0x20, 0xE0)                                           // mov eax, cr4
	op(0x0C, 0x20)                                                 // or al, 0x20: PAE
	op(0x0F, 0x22, 0xE0)                                           // mov cr4, eax
	op(0xB9, 0x80, 0x00, 0x00, 0xC0)                               // mov ecx, 0xC0000080: the EFER MSR
	op(0x0F, 0x32)                                                 // rdmsr
	op(0x66, 0x0D, 0x00, 0x01)                                     // or ax, 0x100: long mode enable
	op(0x0F, 0x30)                                                 // wrmsr
	op(0x0F, 0x20, 0xC0)                                           // mov eax, cr0
	op(0x0D, 0x00, 0x00, 0x00, 0x80)                               // or eax, 0x80000000: paging on, so long mode is active
	op(0x0F, 0x22, 0xC0)                                           // mov cr0, eax
	op(0xEA)
	addr(4, "lm64")
	op(0x18, 0x00) // jmp 0x18:lm64

	// 64-bit long mode.
	label("lm64")
	op(0x66, 0xBA, 0xF8, 0x03) // mov dx, 0x3F8: COM1's data port
	op(0xBE)
	addr(4, "msg") // mov esi, msg
	// next:
	op(0xAC)       // lodsb: al = [rsi], rsi++
	op(0x84, 0xC0) // test al, al
	op(0x74, 0x03) // jz done (over the next 3 bytes)
	op(0xEE)       // out dx, al
	op(0xEB, 0xF8) // jmp next
	// done:
	op(0xF4)       // hlt
	op(0xEB, 0xFD) // jmp done: halt again should anything wake the CPU

	for len(code)%8 != 0 {
		op(0x00) // the GDT is 8-byte aligned
	}
	label("gdt")
	op(0, 0, 0, 0, 0, 0, 0, 0)                         // null descriptor
	op(0xFF, 0xFF, 0x00, 0x00, 0x00, 0x9A, 0xCF, 0x00) // 0x08: flat 32-bit code
	op(0xFF, 0xFF, 0x00, 0x00, 0x00, 0x92, 0xCF, 0x00) // 0x10: flat data
	op(0xFF, 0xFF, 0x00, 0x00, 0x00, 0x9A, 0xAF, 0x00) // 0x18: 64-bit code
	label("gdtr")
	op(4*8-1, 0x00) // limit: four descriptors
	addr(4, "gdt")  // base
	label("msg")
	op([]byte(probeMarker + "\r\n\x00")...)

	for _, f := range fixups {
		v := uint32(org + labels[f.label])
		for i := range f.size {
			code[f.at+i] = byte(v >> (8 * i))
		}
	}
	sector := make([]byte, 512)
	copy(sector, code)
	sector[510], sector[511] = 0x55, 0xAA // boot signature
	return sector
}

// writeProbeDisk writes probeDisk to path as a sparse probeDiskSize file.
func writeProbeDisk(path string) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	_, werr := f.Write(probeDisk())
	terr := f.Truncate(probeDiskSize)
	cerr := f.Close()
	return errors.Join(werr, terr, cerr)
}

// probeArgs boots the probe disk with exactly the machine and CPU arguments
// a VM would get, with the serial port on stdout.
func probeArgs(a Accel, disk string) []string {
	return append(machineArgs(a),
		"-m", "32M", "-smp", "1",
		"-nodefaults", "-no-user-config",
		"-display", "none",
		"-nic", "none",
		// A guest that resets (a triple fault) fails the probe rather than
		// looping until the timeout.
		"-no-reboot",
		"-drive", "if=none,id=root,format=raw,readonly=on,file="+optEscape(disk),
		"-device", "virtio-blk-pci,drive=root,bootindex=1",
		"-chardev", "stdio,id=serial0,signal=off",
		"-serial", "chardev:serial0",
	)
}

// bootProbe boots the probe disk under a and says why it failed, or "" when
// the guest printed its line. QEMU is killed and reaped on every path.
func (b *Backend) bootProbe(ctx context.Context, bin, disk string, a Accel) string {
	timeout := b.tcgProbeTimeout
	if a.Name == accelKVM {
		timeout = b.kvmProbeTimeout
	}
	serial := newWatchWriter(func(s string) bool { return strings.Contains(s, probeMarker) })
	stderr := newWatchWriter(func(s string) bool { return strings.Contains(s, "KVM internal error") })

	cmd := exec.Command(bin, probeArgs(a, disk)...)
	cmd.Stdout, cmd.Stderr = serial, stderr
	// Its own process group, so a wrapper and anything it spawned die
	// together; and dead with the agent, should the agent die first.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = time.Second
	if err := cmd.Start(); err != nil {
		return fmt.Sprintf("cannot run %s: %v", bin, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var cause string
	kvmStopped := false
	select {
	case <-serial.found:
	case <-stderr.found:
		// The guest is paused for good; QEMU would wait forever.
		kvmStopped = true
		select {
		case <-time.After(kvmErrorGrace):
		case err := <-exited:
			exited <- err
		}
	case err := <-exited:
		exited <- err
		if cause = qemuCause(stderr.String()); cause == "" {
			cause = fmt.Sprintf("qemu exited (%v) before the probe guest printed anything", err)
		}
	case <-timer.C:
		if serial.Len() == 0 {
			cause = fmt.Sprintf("probe guest printed nothing in %s", timeout)
		} else {
			cause = fmt.Sprintf("probe guest did not finish its line in %s", timeout)
		}
	case <-ctx.Done():
		cause = ctx.Err().Error()
	}
	_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	<-exited
	if kvmStopped {
		cause = qemuCause(stderr.String()) // now with everything QEMU wrote
	}
	return cause
}

// watchWriter keeps what is written to it (up to probeOutputCap) and closes
// found the first time match accepts the text so far.
type watchWriter struct {
	match func(string) bool
	found chan struct{}

	mu   sync.Mutex
	buf  bytes.Buffer
	done bool
}

func newWatchWriter(match func(string) bool) *watchWriter {
	return &watchWriter{match: match, found: make(chan struct{})}
}

func (w *watchWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if room := probeOutputCap - w.buf.Len(); room > 0 {
		w.buf.Write(p[:min(len(p), room)])
	}
	if !w.done && w.match(w.buf.String()) {
		w.done = true
		close(w.found)
	}
	return len(p), nil
}

func (w *watchWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

func (w *watchWriter) Len() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Len()
}

var (
	msrFailure = regexp.MustCompile(`failed to set MSR (0x[0-9a-fA-F]+)`)
	// qemuPrefix is how QEMU starts its messages: its program name.
	qemuPrefix = regexp.MustCompile(`^\S*qemu[^\s:]*: `)
	kvmWord    = regexp.MustCompile(`(?i)\bkvm`)
	failWord   = regexp.MustCompile(`(?i)fail|error|assert|could not|cannot`)
)

// qemuCause is the short cause of a failure in QEMU's output ("" when the
// output says nothing useful): the known KVM failures by name, else the
// first line that is not a warning, without QEMU's program-name prefix.
func qemuCause(out string) string {
	if m := msrFailure.FindStringSubmatch(out); m != nil {
		return "failed to set MSR " + m[1]
	}
	if strings.Contains(out, "KVM internal error") {
		if strings.Contains(out, "emulation failure") {
			return "KVM internal error (emulation failure)"
		}
		return "KVM internal error"
	}
	for line := range strings.Lines(out) {
		line = strings.TrimSpace(line)
		line = qemuPrefix.ReplaceAllString(line, "")
		line = strings.TrimPrefix(line, "error: ")
		if line == "" || strings.HasPrefix(line, "warning:") || strings.HasPrefix(line, "terminating on signal") {
			continue
		}
		if len(line) > 160 {
			line = line[:157] + "..."
		}
		return line
	}
	return ""
}

// isKVMFailure reports whether QEMU's output names a failure of KVM itself
// (an MSR assertion, an internal error, a kvm_* call or ioctl that failed),
// as opposed to a problem with the VM or its disks.
func isKVMFailure(out string) bool {
	if msrFailure.MatchString(out) || strings.Contains(out, "KVM internal error") {
		return true
	}
	for line := range strings.Lines(out) {
		if kvmWord.MatchString(line) && failWord.MatchString(line) {
			return true
		}
	}
	return false
}
