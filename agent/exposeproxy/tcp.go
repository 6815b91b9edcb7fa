package exposeproxy

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// acceptor is the part of *net.TCPListener the accept loop uses, so a test can
// feed it errors a real listener only produces under descriptor exhaustion.
type acceptor interface {
	AcceptTCP() (*net.TCPConn, error)
	Close() error
}

const (
	acceptBackoffMin = 5 * time.Millisecond
	acceptBackoffMax = time.Second
)

// serveTCP accepts callers for one binding until its listener is closed.
func (p *Proxy) serveTCP(ex *exposure, b *binding, ln acceptor) {
	defer p.wg.Done()
	var (
		capped  streak // refusals at the cap
		starved streak // descriptor exhaustion
		backoff time.Duration
	)
	for {
		c, err := ln.AcceptTCP()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if outOfDescriptors(err) {
				// The pending connection stays in the backlog and Accept would
				// fail again at once: without a pause this loop burns a core
				// exactly when the host is already in trouble.
				backoff = min(max(2*backoff, acceptBackoffMin), acceptBackoffMax)
				if warn, unlogged := starved.begin(p.now); warn {
					p.log.Warn("exposure out of file descriptors, backing off accept",
						"exposure", ex.id, "err", err, "unlogged_streaks", unlogged)
				}
				if !p.sleep(p.ctx, backoff) {
					return
				}
				continue
			}
			reason := err.Error()
			b.dead.Store(&reason)
			ln.Close()
			p.log.Warn("exposure listener failed", "exposure", ex.id, "err", err)
			return
		}
		backoff = 0
		starved.end()

		t := ex.tgt.Load()
		// Count first, then compare: a burst of accepts cannot all read a
		// stale count and slip past the cap together.
		if ex.active.Add(1) > int64(t.max) {
			ex.active.Add(-1)
			ex.refused.Add(1)
			p.log.Debug("exposure refused a connection at its cap",
				"exposure", ex.id, "cap", t.max, "client", c.RemoteAddr())
			if warn, unlogged := capped.begin(p.now); warn {
				p.log.Warn("exposure at its connection cap, refusing callers",
					"exposure", ex.id, "cap", t.max, "unlogged_streaks", unlogged)
			}
			// Closed after the log lines, so whoever sees the close can also
			// see why.
			c.Close()
			continue
		}
		capped.end()
		if !ex.track(c) {
			ex.active.Add(-1)
			c.Close()
			continue
		}
		p.log.Debug("exposure connection opened", "exposure", ex.id, "client", c.RemoteAddr())
		p.wg.Add(1)
		go p.pipe(ex, c, t)
	}
}

// outOfDescriptors reports an accept failure caused by the process or system
// file table being full, which clears by itself once connections close.
func outOfDescriptors(err error) bool {
	return errors.Is(err, syscall.EMFILE) || errors.Is(err, syscall.ENFILE) ||
		errors.Is(err, syscall.ENOBUFS) || errors.Is(err, syscall.ENOMEM)
}

// pipe carries one accepted connection to the guest and back. A guest with no
// address, or one that will not take the connection, closes the caller at
// once and counts a drop: the caller saw the port accept and then go silent,
// and the counter is the only record of why.
func (p *Proxy) pipe(ex *exposure, client *net.TCPConn, t *target) {
	defer p.wg.Done()
	defer func() {
		ex.untrack(client)
		client.Close()
		ex.active.Add(-1)
	}()
	ip, ok := p.cfg.Resolve(t.vmID)
	if !ok {
		ex.dropped.Add(1)
		p.log.Debug("exposure dropped a connection, guest has no address",
			"exposure", ex.id, "vm", t.vmID, "client", client.RemoteAddr())
		return
	}
	to := netip.AddrPortFrom(ip, t.port)
	d := net.Dialer{Timeout: p.cfg.DialTimeout}
	gc, err := d.DialContext(p.ctx, "tcp", to.String())
	if err != nil {
		ex.dropped.Add(1)
		p.log.Debug("exposure dropped a connection, guest dial failed",
			"exposure", ex.id, "guest", to, "client", client.RemoteAddr(), "err", err)
		return
	}
	guest := gc.(*net.TCPConn)
	defer guest.Close()

	done := make(chan struct{})
	go func() {
		defer close(done)
		halfCopy(guest, client, &ex.bytesIn)
	}()
	halfCopy(client, guest, &ex.bytesOut)
	<-done
	p.log.Debug("exposure connection closed", "exposure", ex.id, "client", client.RemoteAddr())
}

// halfCopy moves one direction until src says EOF, then passes the EOF on as
// a half-close so request/response protocols that shut down their write side
// still get their answer. *net.TCPConn.ReadFrom splices on Linux, so the bytes
// never enter userspace. Any error tears down both halves, which also
// unblocks the opposite direction. What each splice moved is added to
// carried, from the count splice returns anyway.
//
// It splices only what src already holds and waits for more itself: a splice
// keeps a pipe (two descriptors and its kernel buffers) for as long as it
// waits, so an idle held connection would cost six descriptors, not two.
func halfCopy(dst, src *net.TCPConn, carried *atomic.Int64) {
	teardown := func() {
		dst.Close()
		src.Close()
	}
	rc, err := src.SyscallConn()
	if err != nil {
		teardown()
		return
	}
	w := newInbound()
	for {
		n, err := w.wait(rc)
		if err != nil {
			teardown()
			return
		}
		if n == 0 {
			break // EOF
		}
		moved, err := dst.ReadFrom(&io.LimitedReader{R: src, N: n})
		// Counted before the error check: a splice cut short still moved
		// these bytes.
		carried.Add(moved)
		if err != nil {
			teardown()
			return
		}
	}
	if err := dst.CloseWrite(); err != nil {
		teardown()
	}
}

// inbound waits for a TCP socket to hold data, holding no buffer meanwhile.
type inbound struct {
	n     int64
	errno error
	peek  [1]byte
	check func(fd uintptr) bool // i.poll, bound once
}

func newInbound() *inbound {
	i := &inbound{}
	i.check = i.poll
	return i
}

// wait returns how many bytes are queued once there are any, or 0 at EOF.
func (i *inbound) wait(rc syscall.RawConn) (int64, error) {
	i.n, i.errno = 0, nil
	if err := rc.Read(i.check); err != nil {
		return 0, err
	}
	return i.n, i.errno
}

func (i *inbound) poll(fd uintptr) bool {
	for {
		n, err := unix.IoctlGetInt(int(fd), unix.SIOCINQ)
		if err != nil {
			i.errno = os.NewSyscallError("ioctl", err)
			return true
		}
		if n > 0 {
			i.n = int64(n)
			return true
		}
		// Nothing queued: EOF, an error, or simply nothing yet.
		got, _, err := unix.Recvfrom(int(fd), i.peek[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN:
			return false
		case err != nil:
			i.errno = os.NewSyscallError("recvfrom", err)
			return true
		case got == 0:
			return true // EOF
		}
		// Data arrived between the two calls: count it.
	}
}
