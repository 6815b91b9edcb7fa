package qemu

import (
	"bytes"
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// chunks collects what FollowSerial emits.
type chunks struct {
	mu  sync.Mutex
	all []SerialChunk
}

func (c *chunks) emit(ch SerialChunk) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.all = append(c.all, ch)
	return nil
}

func (c *chunks) list() []SerialChunk {
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]SerialChunk(nil), c.all...)
}

// text is every byte emitted, in order.
func (c *chunks) text() string {
	var b bytes.Buffer
	for _, ch := range c.list() {
		b.Write(ch.Data)
	}
	return b.String()
}

// follow runs FollowSerial in the background until the test ends.
func follow(t *testing.T, b *Backend, id string, from SerialFrom) *chunks {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &chunks{}
	done := make(chan error, 1)
	go func() { done <- b.FollowSerial(ctx, id, from, c.emit) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	require.Eventually(t, func() bool { return len(c.list()) > 0 }, 5*time.Second, 5*time.Millisecond, "the first chunk comes at once")
	return c
}

func serialBackend(t *testing.T) (*Backend, string) {
	t.Helper()
	b, err := New(Config{Dir: t.TempDir()})
	require.NoError(t, err)
	const id = "vm-console"
	require.NoError(t, os.MkdirAll(b.VMDir(id), 0o700))
	return b, id
}

func appendLog(t *testing.T, path, s string) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	require.NoError(t, err)
	_, err = f.WriteString(s)
	require.NoError(t, err)
	require.NoError(t, f.Close())
}

func TestFollowSerialSendsTheTailThenLiveOutput(t *testing.T) {
	b, id := serialBackend(t)
	log := b.serialPath(id)
	appendLog(t, log, "0123456789")

	c := follow(t, b, id, SerialFrom{Tail: 4})
	first := c.list()[0]
	assert.Equal(t, "6789", string(first.Data), "the last Tail bytes first")
	assert.Equal(t, int64(6), first.Offset)
	assert.NotEmpty(t, first.Boot)
	assert.False(t, first.NewBoot)

	appendLog(t, log, "abc")
	require.Eventually(t, func() bool { return c.text() == "6789abc" }, 5*time.Second, 10*time.Millisecond, "then what is written, live")
}

func TestFollowSerialResumesItsBootAndMarksANewOne(t *testing.T) {
	b, id := serialBackend(t)
	log := b.serialPath(id)
	appendLog(t, log, "boot one says hello\n")
	c := follow(t, b, id, SerialFrom{})
	boot := c.list()[0].Boot

	t.Run("a resume of the same boot repeats nothing", func(t *testing.T) {
		r := follow(t, b, id, SerialFrom{Boot: boot, Offset: 5})
		assert.Equal(t, "one says hello\n", r.text())
		assert.False(t, r.list()[0].NewBoot)
	})
	t.Run("a resume at the end opens with no data", func(t *testing.T) {
		r := follow(t, b, id, SerialFrom{Boot: boot, Offset: 20})
		first := r.list()[0]
		assert.Empty(t, first.Data)
		assert.Equal(t, int64(20), first.Offset)
	})

	// The next boot: the log is rotated away (as rotateSerial does) and
	// QEMU makes a new one.
	require.NoError(t, b.rotateSerial(id))
	appendLog(t, log, "boot two\n")
	require.Eventually(t, func() bool { return c.text() == "boot one says hello\nboot two\n" }, 5*time.Second, 10*time.Millisecond)
	var second SerialChunk
	for _, ch := range c.list() {
		if string(ch.Data) == "boot two\n" {
			second = ch
		}
	}
	assert.True(t, second.NewBoot, "the new boot is marked")
	assert.Equal(t, int64(0), second.Offset)
	assert.NotEqual(t, boot, second.Boot)

	t.Run("a resume of a boot that is gone starts the latest one", func(t *testing.T) {
		r := follow(t, b, id, SerialFrom{Boot: boot, Offset: 20})
		first := r.list()[0]
		assert.Equal(t, "boot two\n", string(first.Data))
		assert.True(t, first.NewBoot)
	})
}

func TestFollowSerialWaitsForAVMThatHasNotBooted(t *testing.T) {
	b, err := New(Config{Dir: t.TempDir()})
	require.NoError(t, err)
	const id = "vm-later"
	c := follow(t, b, id, SerialFrom{})
	assert.Equal(t, SerialChunk{}, c.list()[0], "an empty first chunk says the stream is open")

	require.NoError(t, os.MkdirAll(b.VMDir(id), 0o700))
	appendLog(t, filepath.Join(b.VMDir(id), serialFileName), "first words\n")
	require.Eventually(t, func() bool { return c.text() == "first words\n" }, 5*time.Second, 10*time.Millisecond)
	for _, ch := range c.list() {
		assert.False(t, ch.NewBoot, "the first boot seen is no new boot")
	}
}

func TestSerialInputNeedsARunningVM(t *testing.T) {
	b, id := serialBackend(t)
	ctx := context.Background()
	assert.ErrorIs(t, b.SerialInput(ctx, id, []byte("x")), ErrNotRunning)
	assert.ErrorIs(t, b.SerialInput(ctx, "no-such-vm", []byte("x")), ErrUnknownVM)
	assert.ErrorIs(t, b.SerialInput(ctx, "../escape", []byte("x")), ErrUnknownVM)
	assert.ErrorIs(t, b.FollowSerial(ctx, "../escape", SerialFrom{}, func(SerialChunk) error { return nil }), ErrUnknownVM)
}

func TestTheSerialPortListensForInputAndLogsToThePipeTheAgentReads(t *testing.T) {
	b, id := serialBackend(t)
	args := b.serialArgs(id)
	require.Len(t, args, 4)
	assert.Equal(t, "socket,id=serial0,path="+b.serialSockPath(id)+",server=on,wait=off,logfile="+b.serialPipePath(id), args[1])
	assert.Equal(t, []string{"-serial", "chardev:serial0"}, args[2:])

	long, err := New(Config{Dir: filepath.Join(t.TempDir(), string(bytes.Repeat([]byte("d"), 100)))})
	require.NoError(t, err)
	assert.Equal(t, "null,id=serial0,logfile="+long.serialPipePath(id), long.serialArgs(id)[1],
		"a socket path too long for a unix socket leaves the console read-only")
}

func TestFollowSerialWithoutFollowingReturnsOnceCaughtUp(t *testing.T) {
	b, id := serialBackend(t)
	appendLog(t, b.serialPath(id), "all there is\n")
	c := &chunks{}
	require.NoError(t, b.FollowSerial(context.Background(), id, SerialFrom{NoFollow: true}, c.emit))
	assert.Equal(t, "all there is\n", c.text())
}

// fakeQEMU runs a process the backend takes for the VM's QEMU (its command
// line names the VM's pidfile), with extra arguments, and returns its pid
// once the backend sees it.
func fakeQEMU(t *testing.T, b *Backend, id string, extra ...string) int {
	t.Helper()
	// "; :" keeps sh from exec'ing sleep in its place (dash does for a
	// lone command), which would take the QEMU-like arguments out of the
	// process's command line while the backend is checking them.
	args := append([]string{"-c", "sleep 60; :", "-pidfile", b.pidPath(id)}, extra...)
	cmd := exec.Command("sh", args...)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	require.NoError(t, os.WriteFile(b.pidPath(id), []byte(strconv.Itoa(cmd.Process.Pid)), 0o600))
	// Start returns once the exec is past its point of no return, but the
	// kernel sets up the new command line a moment later: until then
	// /proc/PID/cmdline is empty and the backend rightly sees no QEMU.
	require.Eventually(t, func() bool { _, ok := b.alive(id); return ok }, 5*time.Second, time.Millisecond,
		"the fake QEMU's command line never showed")
	return cmd.Process.Pid
}

func TestInputToAQEMUWithoutTheSocketSaysWhy(t *testing.T) {
	b, id := serialBackend(t)
	fakeQEMU(t, b, id, "-chardev", "file,id=serial0,path="+b.serialPath(id))
	err := b.SerialInput(context.Background(), id, []byte("x"))
	require.ErrorIs(t, err, ErrNoSerialInput)
	assert.Contains(t, err.Error(), "older agent")
}

func TestInputIsWrittenToTheSerialSocket(t *testing.T) {
	b, id := serialBackend(t)
	ln, err := net.Listen("unix", b.serialSockPath(id))
	require.NoError(t, err)
	defer ln.Close()
	fakeQEMU(t, b, id, b.serialArgs(id)...)

	got := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		_, _ = c.Write([]byte("output the log holds too")) // drained by the agent
		buf := make([]byte, 64)
		var all []byte
		for len(all) < len("ls\rpwd\r") {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			all = append(all, buf[:n]...)
		}
		got <- string(all)
	}()
	require.NoError(t, b.SerialInput(context.Background(), id, []byte("ls\r")))
	require.NoError(t, b.SerialInput(context.Background(), id, []byte("pwd\r")))
	select {
	case s := <-got:
		assert.Equal(t, "ls\rpwd\r", s, "both batches, in order, on one connection")
	case <-time.After(5 * time.Second):
		t.Fatal("nothing arrived on the socket")
	}
	b.forgetSerial(id)
}
