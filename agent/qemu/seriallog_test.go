package qemu

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// consoleLines is n bytes of numbered console lines starting at line from,
// so any run of them is told from any other.
func consoleLines(from, n int) []byte {
	var b bytes.Buffer
	for i := from; b.Len() < n; i++ {
		fmt.Fprintf(&b, "[%9d] guest says something on its console\r\n", i)
	}
	return b.Bytes()[:n]
}

// serialFiles is what one boot's serial log takes on disk: serial.log and
// the copy a cut back is making.
func serialFiles(t *testing.T, b *Backend, id string) int64 {
	var total int64
	for _, p := range []string{b.serialPath(id), b.serialPath(id) + ".tmp"} {
		if fi, err := os.Stat(p); err == nil {
			total += fi.Size()
		}
	}
	return total
}

// watchSerialFiles samples serialFiles until the test ends and reports the
// most it saw. (The writer test checks the bound after every write; this
// watches the real copy from outside.)
func watchSerialFiles(t *testing.T, b *Backend, id string) func() int64 {
	var most atomic.Int64
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(200 * time.Microsecond)
		defer tick.Stop()
		for {
			if n := serialFiles(t, b, id); n > most.Load() {
				most.Store(n)
			}
			select {
			case <-stop:
				return
			case <-tick.C:
			}
		}
	}()
	t.Cleanup(func() { close(stop); <-done })
	return most.Load
}

// pipeWriter opens the VM's serial pipe as QEMU does.
func pipeWriter(t *testing.T, b *Backend, id string) *os.File {
	t.Helper()
	w, err := os.OpenFile(b.serialPipePath(id), os.O_WRONLY, 0)
	require.NoError(t, err)
	t.Cleanup(func() { w.Close() })
	return w
}

// startCopy readies a boot's serial log and starts its copy, as launch does
// around QEMU, with the test writing the pipe in QEMU's place.
func startCopy(t *testing.T, b *Backend, id string) *os.File {
	t.Helper()
	c, err := b.prepareSerial(id)
	require.NoError(t, err)
	w := pipeWriter(t, b, id)
	b.runSerial(id, c)
	t.Cleanup(func() { b.stopSerial(id) })
	return w
}

// checkChunks asserts every chunk is the boot's output at its offset, all
// of one boot, in order.
func checkChunks(t *testing.T, c *chunks, out []byte, boot string) {
	t.Helper()
	var end int64
	for _, ch := range c.list() {
		assert.Equal(t, boot, ch.Boot)
		assert.False(t, ch.NewBoot, "a cut back is no new boot")
		assert.GreaterOrEqual(t, ch.Offset, end, "offsets only move on")
		if ch.Offset+int64(len(ch.Data)) <= int64(len(out)) {
			assert.True(t, bytes.Equal(out[ch.Offset:ch.Offset+int64(len(ch.Data))], ch.Data), "the bytes at offset %d are the boot's", ch.Offset)
		} else {
			t.Errorf("chunk at %d (%d bytes) past the %d bytes written", ch.Offset, len(ch.Data), len(out))
		}
		end = ch.Offset + int64(len(ch.Data))
	}
}

// boundedBackend is a backend over dir whose serial logs are bounded to
// bound bytes, with the VM's directory made.
func boundedBackend(t *testing.T, dir string, bound int64, id string) *Backend {
	t.Helper()
	b, err := New(Config{Dir: dir, Log: hosttest.Logger(t), SerialLogMax: bound})
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(b.VMDir(id), 0o700))
	return b
}

func lastEnd(c *chunks) int64 {
	all := c.list()
	if len(all) == 0 {
		return -1
	}
	last := all[len(all)-1]
	return last.Offset + int64(len(last.Data))
}

func TestTheSerialLogWriterNeverPassesItsBoundAndKeepsTheNewestBytes(t *testing.T) {
	b, id := serialBackend(t)
	const bound = 64 << 10
	l, err := newSerialLog(b.serialPath(id), bound)
	require.NoError(t, err)
	defer l.Close()
	boot := l.boot

	out := consoleLines(0, 40*bound)
	for written, i := 0, 0; written < len(out); i++ {
		n := min(1+(i*7919)%9000, len(out)-written) // uneven writes
		m, err := l.Write(out[written : written+n])
		require.NoError(t, err)
		require.Equal(t, n, m)
		written += n

		require.LessOrEqual(t, serialFiles(t, b, id), int64(bound), "after %d bytes", written)
		if i%50 == 0 || written == len(out) {
			kept, err := os.ReadFile(b.serialPath(id))
			require.NoError(t, err)
			require.True(t, bytes.HasSuffix(out[:written], kept), "the log is the newest bytes written, after %d", written)
			f, err := os.Open(b.serialPath(id))
			require.NoError(t, err)
			gotBoot, base, ok := serialOrigin(f, b.serialPath(id))
			f.Close()
			require.True(t, ok)
			assert.Equal(t, boot, gotBoot, "one boot however often it is cut back")
			assert.Equal(t, int64(written-len(kept)), base, "the log starts where its bytes sit in the boot's output")
		}
	}
	kept, err := os.ReadFile(b.serialPath(id))
	require.NoError(t, err)
	assert.GreaterOrEqual(t, len(kept), bound/4, "a cut back keeps a quarter of the bound")
	assert.NoFileExists(t, b.serialPath(id)+".tmp")
}

func TestAFloodThroughTheSerialPipeStaysBoundedAndFollowersGetTheNewestOutput(t *testing.T) {
	const id = "vm-flood"
	b := boundedBackend(t, t.TempDir(), 64<<10, id)
	most := watchSerialFiles(t, b, id)
	w := startCopy(t, b, id)
	live := follow(t, b, id, SerialFrom{})
	boot := live.list()[0].Boot
	require.NotEmpty(t, boot, "the boot's log is there before QEMU writes")

	out := consoleLines(0, int(40*b.cfg.SerialLogMax))
	for rest := out; len(rest) > 0; {
		n, err := w.Write(rest[:min(len(rest), 4096)])
		require.NoError(t, err)
		rest = rest[n:]
	}
	require.NoError(t, w.Close()) // QEMU ends
	b.settleSerial(id)

	kept, err := os.ReadFile(b.serialPath(id))
	require.NoError(t, err)
	assert.True(t, bytes.HasSuffix(out, kept), "the log holds the newest bytes")
	assert.LessOrEqual(t, most(), b.cfg.SerialLogMax, "the log never took more than its bound")

	require.Eventually(t, func() bool { return lastEnd(live) == int64(len(out)) }, 10*time.Second, 5*time.Millisecond,
		"a live follower gets to the newest byte")
	checkChunks(t, live, out, boot)

	t.Run("a tail is the newest bytes, at their offset in the boot", func(t *testing.T) {
		c := &chunks{}
		require.NoError(t, b.FollowSerial(context.Background(), id, SerialFrom{Tail: 1000, NoFollow: true}, c.emit))
		require.NotEmpty(t, c.list())
		assert.Equal(t, int64(len(out)-1000), c.list()[0].Offset)
		assert.Equal(t, string(out[len(out)-1000:]), c.text())
	})
	t.Run("a resume behind what is kept starts at the oldest byte kept, in the same boot", func(t *testing.T) {
		c := &chunks{}
		require.NoError(t, b.FollowSerial(context.Background(), id, SerialFrom{Boot: boot, Offset: 10, NoFollow: true}, c.emit))
		require.NotEmpty(t, c.list())
		assert.Equal(t, int64(len(out)-len(kept)), c.list()[0].Offset)
		assert.Equal(t, string(kept), c.text())
		checkChunks(t, c, out, boot)
	})
}

func TestAFollowerThatKeepsUpLosesNothingAcrossCutBacks(t *testing.T) {
	const id = "vm-steady"
	b := boundedBackend(t, t.TempDir(), 16<<10, id)
	w := startCopy(t, b, id)
	live := follow(t, b, id, SerialFrom{})
	_, keep := serialLogLimits(b.cfg.SerialLogMax)

	out := consoleLines(0, int(4*b.cfg.SerialLogMax))
	for at := 0; at < len(out); {
		next := min(at+int(keep), len(out)) // no more than a cut back keeps
		_, err := w.Write(out[at:next])
		require.NoError(t, err)
		at = next
		require.Eventually(t, func() bool { return lastEnd(live) == int64(at) }, 10*time.Second, 5*time.Millisecond)
	}
	assert.Equal(t, string(out), live.text(), "every byte, once, in order")
	checkChunks(t, live, out, live.list()[0].Boot)
}

func TestTheSerialLogCarriesOnInItsBootAfterAnAgentRestart(t *testing.T) {
	dir := t.TempDir()
	const id = "vm-restart"
	b1 := boundedBackend(t, dir, 16<<10, id)
	pid := fakeQEMU(t, b1, id, b1.serialArgs(id)...)
	w := startCopy(t, b1, id)

	before := consoleLines(0, 40<<10)
	_, err := w.Write(before)
	require.NoError(t, err)
	live := follow(t, b1, id, SerialFrom{})
	require.Eventually(t, func() bool { return lastEnd(live) == int64(len(before)) }, 10*time.Second, 5*time.Millisecond)
	boot := live.list()[0].Boot

	b2 := boundedBackend(t, dir, 16<<10, id)
	b2.adoptSerial(id, pid)
	assert.Empty(t, b2.copies.by, "a pipe another agent still reads is left to it")

	b1.stopSerial(id) // the first agent dies
	_, err = w.Write([]byte("said while no agent listens\n"))
	assert.ErrorIs(t, err, syscall.EPIPE, "QEMU's write fails at once instead of waiting for an agent")

	b2.adoptSerial(id, pid)
	t.Cleanup(func() { b2.stopSerial(id) })
	after := consoleLines(100000, 30<<10)
	_, err = w.Write(after)
	require.NoError(t, err)
	require.NoError(t, w.Close())
	b2.settleSerial(id)

	out := append(append([]byte(nil), before...), after...)
	kept, err := os.ReadFile(b2.serialPath(id))
	require.NoError(t, err)
	assert.True(t, bytes.HasSuffix(out, kept), "the log goes on with what came after the restart")
	assert.LessOrEqual(t, int64(len(kept)), b2.cfg.SerialLogMax)

	c := &chunks{}
	require.NoError(t, b2.FollowSerial(context.Background(), id, SerialFrom{Boot: boot, Offset: int64(len(out) - 100), NoFollow: true}, c.emit))
	assert.Equal(t, string(out[len(out)-100:]), c.text(), "a resume from before the restart lands in the same boot at the same offsets")
	checkChunks(t, c, out, boot)
}

func TestAQEMUThatWritesItsOwnSerialLogIsLeftToIt(t *testing.T) {
	var logs hosttest.LogBuffer
	b, err := New(Config{Dir: t.TempDir(), Log: logs.Logger()})
	require.NoError(t, err)
	const id = "vm-older"
	require.NoError(t, os.MkdirAll(b.VMDir(id), 0o700))
	pid := fakeQEMU(t, b, id, "-chardev", "socket,id=serial0,path="+b.serialSockPath(id)+",server=on,wait=off,logfile="+b.serialPath(id))
	b.adoptSerial(id, pid)
	assert.Empty(t, b.copies.by, "an older agent's QEMU keeps writing serial.log itself")
	assert.NoFileExists(t, b.serialPipePath(id))
	// Told from its command line, not from a pipe that fails to open: that
	// is no fault to warn about.
	assert.NotContains(t, logs.String(), "level=WARN")
}

// floodDisk is a boot sector that writes a line to COM1 forever, as fast
// as the CPU lets it, never waiting for the UART.
func floodDisk(t *testing.T) string {
	t.Helper()
	const org = 0x7C00
	code := []byte{
		0xFA,       // cli
		0xFC,       // cld: lodsb walks forward
		0x31, 0xC0, // xor ax, ax
		0x8E, 0xD8, // mov ds, ax
		0xBA, 0xF8, 0x03, // mov dx, 0x3F8: COM1
		0xBE, 0, 0, // again: mov si, msg
		0xAC,       // next: lodsb
		0x84, 0xC0, // test al, al
		0x74, 0xF8, // jz again
		0xEE,       // out dx, al
		0xEB, 0xF8, // jmp next
	}
	msg := org + len(code)
	code[10], code[11] = byte(msg), byte(msg>>8)
	code = append(code, "EITRI-FLOOD the guest will not stop talking\r\n\x00"...)
	disk := make([]byte, 1<<20)
	copy(disk, code)
	disk[510], disk[511] = 0x55, 0xAA
	path := filepath.Join(t.TempDir(), "flood.raw")
	require.NoError(t, os.WriteFile(path, disk, 0o600))
	return path
}

// pipeHolders counts the processes' open descriptors of the pipe, by mode.
func pipeHolders(t *testing.T, pid int, pipe string) (readers, writers int) {
	t.Helper()
	fi, err := os.Stat(pipe)
	require.NoError(t, err)
	fds, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	require.NoError(t, err)
	for _, fd := range fds {
		st, err := os.Stat("/proc/" + strconv.Itoa(pid) + "/fd/" + fd.Name())
		if err != nil || !os.SameFile(st, fi) {
			continue
		}
		info, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/fdinfo/" + fd.Name())
		require.NoError(t, err)
		var flags int
		for _, line := range bytes.Split(info, []byte("\n")) {
			if v, ok := bytes.CutPrefix(line, []byte("flags:")); ok {
				f, err := strconv.ParseInt(string(bytes.TrimSpace(v)), 8, 64)
				require.NoError(t, err)
				flags = int(f)
			}
		}
		if flags&syscall.O_ACCMODE == syscall.O_WRONLY {
			writers++
		} else {
			readers++
		}
	}
	return readers, writers
}

func TestAGuestFloodingItsSerialPortKeepsItsLogBoundedAcrossAnAgentRestart(t *testing.T) {
	hosttest.NeedQEMU(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir := t.TempDir()
	const bound = 64 << 10
	b, err := New(Config{Dir: dir, Log: hosttest.Logger(t), Accel: AccelTCG, SerialLogMax: bound})
	require.NoError(t, err)
	vm := VM{ID: "vm-flood", VCPUs: 1, MemMB: 64, RootDisk: floodDisk(t)}
	t.Cleanup(func() { _ = b.Destroy(context.Background(), vm.ID) })
	most := watchSerialFiles(t, b, vm.ID)

	require.NoError(t, b.Start(ctx, vm))
	pid, ok := b.PID(vm.ID)
	require.True(t, ok)
	readers, writers := pipeHolders(t, pid, b.serialPipePath(vm.ID))
	assert.Equal(t, [2]int{0, 1}, [2]int{readers, writers}, "QEMU only writes the pipe: with no agent reading, its writes fail instead of filling it")

	live := follow(t, b, vm.ID, SerialFrom{})
	require.Eventually(t, func() bool { return lastEnd(live) > 4*bound }, time.Minute, 10*time.Millisecond,
		"the guest writes four times the bound")
	boot := live.list()[len(live.list())-1].Boot
	assert.LessOrEqual(t, most(), int64(bound), "bounded while the guest floods")

	// The agent dies and another adopts the QEMU: the guest runs on, and
	// the log carries on in the same boot.
	b.stopSerial(vm.ID)
	b2, err := New(Config{Dir: dir, Log: hosttest.Logger(t), Accel: AccelTCG, SerialLogMax: bound})
	require.NoError(t, err)
	adopted, err := b2.Adopt(ctx, vm.ID)
	require.NoError(t, err)
	require.True(t, adopted)
	since := lastEnd(live)
	require.Eventually(t, func() bool { return lastEnd(live) > since+2*bound }, time.Minute, 10*time.Millisecond,
		"the adopted guest's output reaches the log again")
	running, err := b2.Running(ctx, vm.ID)
	require.NoError(t, err)
	assert.True(t, running)
	for _, ch := range live.list() {
		assert.Equal(t, boot, ch.Boot)
		assert.False(t, ch.NewBoot)
	}
	assert.LessOrEqual(t, most(), int64(bound), "bounded across the restart")
	assert.Contains(t, b2.SerialTail(vm.ID, 3), "EITRI-FLOOD the guest will not stop talking")

	require.NoError(t, b2.Kill(ctx, vm.ID))
	assert.NoFileExists(t, b2.serialPipePath(vm.ID))
}
