package qemu

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The serial console. QEMU writes the guest's serial output to the
// chardev's logfile, which the agent keeps as serial.log (seriallog.go: the
// log is complete whether or not anyone is connected, and bounded), and
// takes input on serial.sock, a unix socket it listens on. Output is read
// from the log, never from the socket: a follower that falls behind then
// costs the guest nothing. A connection to the socket is made
// only to type, and is drained while it is open, since QEMU would stall the
// guest's UART on a full socket.

const (
	serialSockName = "serial.sock"
	// serialPoll is how often a follower looks for more output at the end
	// of the log.
	serialPoll = 150 * time.Millisecond
	// serialChunk bounds one chunk of output handed to a follower.
	serialChunk = 32 << 10
	// DefaultSerialTail is how much of the output already written a
	// follower gets first when it names no resume point.
	DefaultSerialTail = 16 << 10
	// MaxSerialTail bounds that, and where a follower of a boot it did not
	// know starts in the latest one.
	MaxSerialTail = 1 << 20
	// serialIdle closes an input connection nobody typed on for this long.
	serialIdle = time.Minute
	// serialWriteTimeout bounds one write of input: a guest that does not
	// read its console lets the socket fill up.
	serialWriteTimeout = 5 * time.Second
)

var (
	// ErrUnknownVM: this host has no such VM.
	ErrUnknownVM = errors.New("no such vm on this host")
	// ErrNotRunning: the VM's QEMU is not running, so nothing takes input.
	ErrNotRunning = errors.New("the vm is not running")
	// ErrNoSerialInput: the VM's QEMU has no input socket (an older agent
	// started it); it gets one when it boots again.
	ErrNoSerialInput = errors.New("this vm's qemu was started by an older agent without a console input socket; stop and start the vm to type into its console")
)

func (b *Backend) serialSockPath(id string) string {
	return filepath.Join(b.VMDir(id), serialSockName)
}

// serialArgs is the serial port's chardev: a listening socket logging to
// the serial pipe, or only the log when the socket path is too long for a
// unix socket (the console is then read-only).
func (b *Backend) serialArgs(id string) []string {
	log := optEscape(b.serialPipePath(id))
	chardev := "null,id=serial0,logfile=" + log
	if sock := b.serialSockPath(id); len(sock) <= maxUnixPath {
		chardev = "socket,id=serial0,path=" + optEscape(sock) + ",server=on,wait=off,logfile=" + log
	}
	return []string{"-chardev", chardev, "-serial", "chardev:serial0"}
}

// SerialChunk is a piece of a VM's serial output.
type SerialChunk struct {
	Data []byte
	// Boot names the QEMU run the bytes come from; Offset is where Data
	// starts in that run's output.
	Boot   string
	Offset int64
	// NewBoot: Data starts a run other than the one the follower was on
	// or asked to resume.
	NewBoot bool
}

// SerialFrom is where a follower starts: Boot and Offset to resume (from
// an earlier SerialChunk), else the last Tail bytes (0: DefaultSerialTail).
type SerialFrom struct {
	Boot   string
	Offset int64
	Tail   int64
	// NoFollow: return once the output written so far is emitted.
	NoFollow bool
}

// FollowSerial hands the VM's serial output to emit from the start point,
// then every byte the guest writes, across reboots, until ctx ends or emit
// fails. The first call of emit comes at once, with no data if there is
// none yet: a VM still being created has written nothing, and is followed
// from its first boot. Only ErrUnknownVM (an id no VM can have) and emit's
// errors are returned (ctx's end returns nil).
func (b *Backend) FollowSerial(ctx context.Context, id string, from SerialFrom, emit func(SerialChunk) error) error {
	if checkID(id) != nil {
		return ErrUnknownVM
	}
	tail := from.Tail
	if tail <= 0 {
		tail = DefaultSerialTail
	}
	tail = min(tail, MaxSerialTail)
	fl := follower{path: b.serialPath(id), emit: emit, buf: make([]byte, serialChunk)}
	if err := fl.open(from, tail); err != nil {
		return err
	}
	defer fl.close()
	tick := time.NewTicker(serialPoll)
	defer tick.Stop()
	for {
		if err := fl.drain(); err != nil {
			return err
		}
		if from.NoFollow {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
		if err := fl.next(); err != nil {
			return err
		}
	}
}

// follower reads one VM's serial log.
type follower struct {
	path string
	emit func(SerialChunk) error
	buf  []byte

	f    *os.File // nil while there is no log
	boot string
	// base is where f's first byte sits in the boot's output (a log cut
	// back to its newest bytes starts past 0); off is in that output.
	base, off int64
	newBoot   bool // the next chunk starts a boot the reader did not know
}

// bootID names a log file: its inode and birth time, so a new boot's log
// (a new file, see rotateSerial) reads differently even when the
// filesystem reuses the inode.
func bootID(f *os.File) string {
	var sx unix.Statx_t
	if err := unix.Statx(int(f.Fd()), "", unix.AT_EMPTY_PATH, unix.STATX_INO|unix.STATX_BTIME, &sx); err != nil {
		return ""
	}
	return strconv.FormatUint(sx.Ino, 36) + "." + strconv.FormatInt(sx.Btime.Sec, 36) + "." + strconv.FormatUint(uint64(sx.Btime.Nsec), 36)
}

// open places the reader: at the resume point when from names the current
// boot, else at the last tail bytes (a resume of another boot is told it
// is a new one). The first emit goes out from here.
func (fl *follower) open(from SerialFrom, tail int64) error {
	f, boot, base, ok := openSerialLog(fl.path)
	if !ok {
		// No log yet (the VM has not booted): say the stream is open.
		return fl.emit(SerialChunk{})
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return fl.emit(SerialChunk{})
	}
	fl.f, fl.boot, fl.base = f, boot, base
	end := base + fi.Size()
	switch {
	case from.Boot != "" && from.Boot == fl.boot:
		fl.off = min(max(from.Offset, base), end)
	case from.Boot != "":
		fl.off, fl.newBoot = max(end-MaxSerialTail, base), true
	default:
		fl.off = max(end-tail, base)
	}
	if fl.off == end {
		return fl.emit(SerialChunk{Boot: fl.boot, Offset: fl.off, NewBoot: fl.takeNewBoot()})
	}
	return nil
}

func (fl *follower) takeNewBoot() bool {
	nb := fl.newBoot
	fl.newBoot = false
	return nb
}

// drain emits everything from the offset to the end of the open log.
func (fl *follower) drain() error {
	if fl.f == nil {
		return nil
	}
	for {
		n, err := fl.f.ReadAt(fl.buf, fl.off-fl.base)
		if n > 0 {
			data := append([]byte(nil), fl.buf[:n]...)
			if err := fl.emit(SerialChunk{Data: data, Boot: fl.boot, Offset: fl.off, NewBoot: fl.takeNewBoot()}); err != nil {
				return err
			}
			fl.off += int64(n)
		}
		if err != nil || n == 0 {
			return nil // io.EOF: caught up
		}
	}
}

// next notices a new boot: the log replaced by a new file (or first
// made), or cut back in place; and a log of the same boot cut back to its
// newest bytes, where the reader carries on.
func (fl *follower) next() error {
	cur, err := os.Stat(fl.path)
	if err != nil {
		return nil // between boots, or not booted yet
	}
	if fl.f != nil {
		if open, err := fl.f.Stat(); err == nil && os.SameFile(open, cur) {
			if fl.base+open.Size() >= fl.off {
				return nil
			}
			fl.off, fl.newBoot = fl.base, true // cut back: the file was reused
			return nil
		}
		// Replaced: what the old file holds last is read before leaving it.
		if err := fl.drain(); err != nil {
			return err
		}
	}
	f, boot, base, ok := openSerialLog(fl.path)
	if !ok {
		return nil
	}
	had := fl.f != nil
	fl.close()
	if had && boot == fl.boot {
		// The same boot, cut back: on from the reader's offset, or from the
		// oldest byte kept if it fell further behind.
		fl.f, fl.base, fl.off = f, base, max(fl.off, base)
		return nil
	}
	fl.f, fl.boot, fl.base, fl.off, fl.newBoot = f, boot, base, base, had
	return nil
}

func (fl *follower) close() {
	if fl.f != nil {
		fl.f.Close()
		fl.f = nil
	}
}

// serialConns holds the open input connection of each VM.
type serialConns struct {
	mu sync.Mutex
	by map[string]*serialConn
}

type serialConn struct {
	mu   writeLock // one writer at a time
	conn net.Conn  // nil once closed
	idle *time.Timer
}

// SerialInput types data into the VM's serial console.
func (b *Backend) SerialInput(ctx context.Context, id string, data []byte) error {
	if checkID(id) != nil {
		return ErrUnknownVM
	}
	if _, err := os.Stat(b.VMDir(id)); err != nil {
		return ErrUnknownVM
	}
	pid, ok := b.alive(id)
	if !ok {
		return ErrNotRunning
	}
	if !b.hasSerialSocket(pid, id) {
		return ErrNoSerialInput
	}
	c := b.serialConn(id)
	if err := c.mu.LockContext(ctx); err != nil {
		return fmt.Errorf("console input: an earlier input to this vm is still being written (is the guest reading its console?): %w", err)
	}
	defer c.mu.Unlock()
	// One retry: a kept connection may belong to a QEMU that has since
	// been replaced by a new boot's.
	var err error
	for range 2 {
		if c.conn == nil {
			if err = c.dial(ctx, b.serialSockPath(id)); err != nil {
				if ctx.Err() != nil {
					err = ctx.Err()
				}
				break
			}
		}
		c.idle.Reset(serialIdle)
		if err = c.write(ctx, data); err == nil {
			return nil
		}
		c.closeLocked()
		if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
			return fmt.Errorf("console input: %w", err)
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("the guest is not reading its console: %w", err)
		}
	}
	return fmt.Errorf("console input: %w", err)
}

// hasSerialSocket tells a QEMU started with the input socket (by this
// agent or a like one) from one an older agent started with a file only.
func (b *Backend) hasSerialSocket(pid int, id string) bool {
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return false
	}
	return strings.Contains(string(cmdline), "socket,id=serial0,path="+optEscape(b.serialSockPath(id))+",")
}

func (b *Backend) serialConn(id string) *serialConn {
	b.serial.mu.Lock()
	defer b.serial.mu.Unlock()
	if b.serial.by == nil {
		b.serial.by = map[string]*serialConn{}
	}
	c, ok := b.serial.by[id]
	if !ok {
		c = &serialConn{mu: make(writeLock, 1)}
		c.idle = time.AfterFunc(serialIdle, func() {
			c.mu.Lock()
			c.closeLocked()
			c.mu.Unlock()
		})
		b.serial.by[id] = c
	}
	return c
}

// forgetSerial closes the VM's input connection (its QEMU is gone).
func (b *Backend) forgetSerial(id string) {
	b.serial.mu.Lock()
	c := b.serial.by[id]
	delete(b.serial.by, id)
	b.serial.mu.Unlock()
	if c != nil {
		c.idle.Stop()
		c.mu.Lock()
		c.closeLocked()
		c.mu.Unlock()
	}
}

func (c *serialConn) dial(ctx context.Context, path string) error {
	ctx, cancel := context.WithTimeout(ctx, serialWriteTimeout)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(ctx, "unix", path)
	if err != nil {
		return err
	}
	c.conn = conn
	// What QEMU sends on the socket is the output the log already holds;
	// read and dropped so the guest's UART never waits on this socket.
	go func() { _, _ = io.Copy(io.Discard, conn) }()
	return nil
}

func (c *serialConn) closeLocked() {
	if c.conn != nil {
		c.conn.Close()
		c.conn = nil
	}
}
