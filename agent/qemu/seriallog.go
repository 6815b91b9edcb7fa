package qemu

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The serial log, bounded while the guest runs.
//
// QEMU would write its chardev's logfile itself and never bound it, and a
// file QEMU holds open cannot be cut back under it. So the logfile QEMU is
// given is a named pipe (serial.pipe), and the agent copies what comes out
// of it into serial.log, the log's only writer. serial.log grows to three
// quarters of the bound; then its newest quarter is copied into a new file
// that replaces it, so the two together never pass the bound.
//
// A pipe rather than the console socket: the socket takes one client, the
// input's, and QEMU drops output while none is connected, so a boot's first
// lines would be lost. The pipe is made, and opened for reading, before
// QEMU starts: QEMU's open of it does not wait, and a boot is logged from
// its first byte. While no agent reads it (the agent is down or
// restarting) QEMU's writes fail at once (EPIPE; QEMU ignores SIGPIPE and
// drops the bytes): the guest never waits and nothing grows, and that
// output is missing from the log. The next agent opens the pipe again when
// it adopts the QEMU and carries on in the same serial.log. A live agent
// must keep reading (QEMU would wait on a full pipe), so the copy waits on
// nothing but the pipe and the disk. Input (serial.sock) is untouched.
//
// Followers see offsets in the boot's output, not in the file: a cut-back
// log's boot and where its first byte sits in that boot's output are
// recorded in serial.log.base before the new file replaces the old one. A
// log with no entry there is its boot's first: its identity (bootID) names
// the boot and it starts at offset 0, as every log QEMU itself wrote for an
// agent older than this one.

const (
	serialPipeName = "serial.pipe"
	// serialBaseSuffix names, beside serial.log, where a cut-back log
	// starts in its boot's output.
	serialBaseSuffix = ".base"
	// DefaultSerialLogMax is the default of Config.SerialLogMax.
	DefaultSerialLogMax = 4 << 20
	// minSerialLogMax keeps a configured bound sensible.
	minSerialLogMax = 4 << 10
	// serialPipeSize is the pipe's buffer: output QEMU can hand over while
	// the agent is busy (a disk stall, a cut back) before it waits.
	serialPipeSize = 1 << 20
	// serialSettle bounds the wait for the last output of a QEMU that has
	// ended to reach the log.
	serialSettle = 2 * time.Second
	// serialCopyChunk is one read from the pipe.
	serialCopyChunk = 64 << 10
)

// errSerialLogGone: serial.log is no longer the file this writer writes (a
// new boot's log replaced it); what is left of its output is dropped.
var errSerialLogGone = errors.New("the serial log was replaced by a newer boot's")

func (b *Backend) serialPipePath(id string) string {
	return filepath.Join(b.VMDir(id), serialPipeName)
}

// serialLog is the writer of one boot's serial.log.
type serialLog struct {
	path string
	// limit is how large the file grows; keep is how much of it a cut back
	// keeps. limit+keep is the bound.
	limit, keep int64

	f    *os.File
	size int64
	id   string // f's identity (bootID)
	boot string
	base int64 // where f's first byte sits in the boot's output
	gone bool
}

func serialLogLimits(bound int64) (limit, keep int64) {
	bound = max(bound, minSerialLogMax)
	return bound - bound/4, bound / 4
}

// newSerialLog starts the log of a new boot: an empty serial.log, a file of
// its own (never one reused), whose identity names the boot.
func newSerialLog(path string, bound int64) (*serialLog, error) {
	for _, p := range []string{path, path + ".tmp", path + serialBaseSuffix} {
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return nil, err
		}
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	l := &serialLog{path: path, f: f, id: bootID(f)}
	l.limit, l.keep = serialLogLimits(bound)
	l.boot = l.id
	return l, nil
}

// reopenSerialLog carries on the log of a boot an earlier agent process was
// writing, in the same file and at the same offsets.
func reopenSerialLog(path string, bound int64) (*serialLog, error) {
	_ = os.Remove(path + ".tmp") // a cut back the earlier agent did not finish
	f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND, 0o600)
	if errors.Is(err, os.ErrNotExist) {
		return newSerialLog(path, bound)
	}
	if err != nil {
		return nil, err
	}
	boot, base, ok := serialOrigin(f, path)
	fi, err := f.Stat()
	if !ok || err != nil {
		f.Close()
		return nil, fmt.Errorf("serial log %s changed while it was opened", path)
	}
	l := &serialLog{path: path, f: f, size: fi.Size(), id: bootID(f), boot: boot, base: base}
	l.limit, l.keep = serialLogLimits(bound)
	return l, nil
}

// Write appends p, cutting the log back whenever it reaches its limit. On
// an error the rest of p is dropped, never written past the bound.
func (l *serialLog) Write(p []byte) (int, error) {
	written := 0
	for len(p) > 0 {
		if l.gone {
			return written, errSerialLogGone
		}
		if l.size >= l.limit {
			if err := l.cutBack(); err != nil {
				return written, err
			}
		}
		n, err := l.f.Write(p[:min(int64(len(p)), l.limit-l.size)])
		l.size += int64(n)
		written += n
		p = p[n:]
		if err != nil {
			return written, err
		}
	}
	return written, nil
}

// cutBack replaces serial.log by a new file holding its last keep bytes.
// The base file names the new file before it takes serial.log's place, and
// still names the old one, so a reader always finds where the file it
// opened starts.
func (l *serialLog) cutBack() error {
	cur, err := os.Stat(l.path)
	if open, ferr := l.f.Stat(); err != nil || ferr != nil || !os.SameFile(cur, open) {
		l.gone = true
		return errSerialLogGone
	}
	keep := min(l.keep, l.size)
	tmp := l.path + ".tmp"
	nf, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	id := bootID(nf)
	base := l.base + l.size - keep
	_, err = io.Copy(nf, io.NewSectionReader(l.f, l.size-keep, keep))
	if err == nil && id == "" {
		err = errors.New("cannot name the new serial log")
	}
	if err == nil {
		err = writeSerialBase(l.path+serialBaseSuffix, l.boot, id, base, l.id, l.base)
	}
	if err == nil {
		err = os.Rename(tmp, l.path)
	}
	if err != nil {
		nf.Close()
		_ = os.Remove(tmp)
		return err
	}
	l.f.Close()
	l.f, l.size, l.id, l.base = nf, keep, id, base
	return nil
}

func (l *serialLog) Close() error { return l.f.Close() }

// writeSerialBase records, atomically, the boot and the start of the
// current cut-back log (id) and of the one it replaced (prevID).
func writeSerialBase(path, boot, id string, base int64, prevID string, prevBase int64) error {
	text := boot + "\n" + id + " " + strconv.FormatInt(base, 10) + "\n"
	if prevID != "" {
		text += prevID + " " + strconv.FormatInt(prevBase, 10) + "\n"
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// serialOrigin names the boot an open serial log belongs to and where its
// first byte sits in that boot's output. ok is false for a log that was
// replaced after it was opened and is not in the base file: the caller
// opens serial.log again.
func serialOrigin(f *os.File, path string) (boot string, base int64, ok bool) {
	id := bootID(f)
	if data, err := os.ReadFile(path + serialBaseSuffix); err == nil {
		lines := strings.Split(strings.TrimSpace(string(data)), "\n")
		for _, line := range lines[1:] {
			fid, at, _ := strings.Cut(line, " ")
			if n, err := strconv.ParseInt(at, 10, 64); err == nil && n >= 0 && fid == id && id != "" {
				return lines[0], n, true
			}
		}
	}
	if fi, err := f.Stat(); err == nil {
		if st, isUnix := fi.Sys().(*syscall.Stat_t); isUnix && st.Nlink == 0 {
			return "", 0, false
		}
	}
	return id, 0, true
}

// openSerialLog opens serial.log for reading, with its boot and where it
// starts in that boot's output.
func openSerialLog(path string) (f *os.File, boot string, base int64, ok bool) {
	for range 3 {
		f, err := os.Open(path)
		if err != nil {
			return nil, "", 0, false
		}
		if boot, base, ok := serialOrigin(f, path); ok {
			return f, boot, base, true
		}
		f.Close() // cut back meanwhile: open the newer file
	}
	return nil, "", 0, false
}

// serialCopy copies one QEMU's serial output from the pipe into its log
// until QEMU's end of the pipe closes (QEMU ended) or the pipe is closed
// here.
type serialCopy struct {
	pipe *os.File
	log  *serialLog
	done chan struct{}
}

// serialCopies holds the running copy of each VM.
type serialCopies struct {
	mu sync.Mutex
	by map[string]*serialCopy
}

// openSerialPipe opens the VM's pipe for reading and takes it for this
// copy: false (and no error) when another copy already reads it (another
// Backend over the same directory, or an earlier agent still alive).
func openSerialPipe(path string) (*os.File, bool, error) {
	// Non-blocking: the open does not wait for QEMU, and reads go through
	// the poller, so closing the file ends a read.
	p, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, false, err
	}
	rc, err := p.SyscallConn()
	if err != nil {
		p.Close()
		return nil, false, err
	}
	var lockErr error
	if err := rc.Control(func(fd uintptr) {
		if lockErr = unix.Flock(int(fd), unix.LOCK_EX|unix.LOCK_NB); lockErr == nil {
			_, _ = unix.FcntlInt(fd, unix.F_SETPIPE_SZ, serialPipeSize)
		}
	}); err != nil {
		lockErr = err
	}
	if lockErr != nil {
		p.Close()
		if errors.Is(lockErr, unix.EWOULDBLOCK) {
			return nil, false, nil
		}
		return nil, false, lockErr
	}
	return p, true, nil
}

// prepareSerial readies the serial log of a boot about to start: a new
// serial.log, and the pipe QEMU is to write, made again and open for
// reading. runSerial starts the copy once QEMU has started (or failed to).
func (b *Backend) prepareSerial(id string) (*serialCopy, error) {
	pipe := b.serialPipePath(id)
	if err := os.Remove(pipe); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	if err := unix.Mkfifo(pipe, 0o600); err != nil {
		return nil, fmt.Errorf("make %s: %w", pipe, err)
	}
	p, ok, err := openSerialPipe(pipe)
	if err == nil && !ok {
		err = errors.New("a new pipe is already taken")
	}
	if err != nil {
		return nil, err
	}
	l, err := newSerialLog(b.serialPath(id), b.cfg.SerialLogMax)
	if err != nil {
		p.Close()
		return nil, err
	}
	return &serialCopy{pipe: p, log: l, done: make(chan struct{})}, nil
}

// adoptSerial carries on the copy of the serial output of a running QEMU
// an earlier agent process started, when that QEMU logs to the pipe (one
// an agent older than this one started writes serial.log itself).
func (b *Backend) adoptSerial(id string, pid int) {
	if b.runningCopy(id) != nil {
		return
	}
	cmdline, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil || !strings.Contains(string(cmdline), "logfile="+optEscape(b.serialPipePath(id))+"\x00") {
		b.log.Debug("vm's qemu writes its serial log itself (started by an older agent); it is bounded from its next boot", "id", id)
		return
	}
	p, ok, err := openSerialPipe(b.serialPipePath(id))
	if err != nil || !ok {
		if err != nil {
			b.log.Warn("cannot read the vm's serial output; its console shows nothing new until it boots again", "id", id, "err", err)
		}
		return
	}
	l, err := reopenSerialLog(b.serialPath(id), b.cfg.SerialLogMax)
	if err != nil {
		p.Close()
		b.log.Warn("cannot open the vm's serial log; its console shows nothing new until it boots again", "id", id, "err", err)
		return
	}
	b.runSerial(id, &serialCopy{pipe: p, log: l, done: make(chan struct{})})
}

// runningCopy is the VM's running copy, or nil.
func (b *Backend) runningCopy(id string) *serialCopy {
	b.copies.mu.Lock()
	defer b.copies.mu.Unlock()
	return b.copies.by[id]
}

// runSerial starts c, the VM's copy.
func (b *Backend) runSerial(id string, c *serialCopy) {
	b.copies.mu.Lock()
	if b.copies.by == nil {
		b.copies.by = map[string]*serialCopy{}
	}
	b.copies.by[id] = c
	b.copies.mu.Unlock()
	go func() {
		defer func() {
			c.pipe.Close()
			c.log.Close()
			b.copies.mu.Lock()
			if b.copies.by[id] == c {
				delete(b.copies.by, id)
			}
			b.copies.mu.Unlock()
			close(c.done)
		}()
		buf := make([]byte, serialCopyChunk)
		warned := false
		for {
			// Read on whatever happens to the log: QEMU must never wait on it.
			n, err := c.pipe.Read(buf)
			if n > 0 {
				if _, werr := c.log.Write(buf[:n]); werr != nil && !warned {
					b.log.Warn("cannot write the vm's serial log; its output is dropped", "id", id, "err", werr)
					warned = true
				}
			}
			if err != nil {
				return // io.EOF: QEMU ended
			}
		}
	}()
}

// settleSerial waits until all a VM's QEMU wrote is in its log: the copy
// ends when the QEMU, which has ended, no longer holds the pipe. Past
// serialSettle the copy is stopped.
func (b *Backend) settleSerial(id string) {
	c := b.runningCopy(id)
	if c == nil {
		return
	}
	select {
	case <-c.done:
		return
	case <-time.After(serialSettle):
	}
	b.log.Warn("the vm's qemu has ended but its serial pipe is still open; the copy is stopped", "id", id)
	b.stopSerial(id)
}

// stopSerial ends the VM's copy now; a QEMU still running then writes to a
// pipe nobody reads, and drops its output without waiting.
func (b *Backend) stopSerial(id string) {
	c := b.runningCopy(id)
	if c == nil {
		return
	}
	c.pipe.Close()
	<-c.done
}
