package exposeproxy

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// maxDatagram holds any UDP payload IPv4 or IPv6 (without jumbograms) carries.
const maxDatagram = 64 << 10

// bufPool lends datagram buffers only for the moment a datagram is in hand.
// Waiting readers hold none (see recvFrom), so an idle exposure or a quiet
// session costs a goroutine and a socket, not 64 KiB.
var bufPool = sync.Pool{New: func() any { b := make([]byte, maxDatagram); return &b }}

// recvFrom waits for one datagram on rc without holding a buffer while it
// waits: the buffer is taken only once the socket is readable, and handed back
// if the read would block. The caller returns the buffer to bufPool.
func recvFrom(rc syscall.RawConn) (*[]byte, int, netip.AddrPort, error) {
	var (
		buf  *[]byte
		n    int
		from unix.Sockaddr
		rerr error
	)
	err := rc.Read(func(fd uintptr) bool {
		b := bufPool.Get().(*[]byte)
		for {
			n, from, rerr = unix.Recvfrom(int(fd), *b, unix.MSG_DONTWAIT)
			if rerr != unix.EINTR {
				break
			}
		}
		if rerr == unix.EAGAIN {
			bufPool.Put(b)
			return false // wait for readability, then call again
		}
		buf = b
		return true
	})
	if err == nil && rerr != nil {
		err = os.NewSyscallError("recvfrom", rerr)
	}
	if err != nil {
		if buf != nil {
			bufPool.Put(buf)
		}
		return nil, 0, netip.AddrPort{}, err
	}
	return buf, n, sockaddrAddrPort(from), nil
}

func sockaddrAddrPort(sa unix.Sockaddr) netip.AddrPort {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port))
	}
	return netip.AddrPort{}
}

// session is one client's conversation with the guest: its own connected
// socket toward the guest, so replies can be told apart by socket rather than
// by guest source port.
type session struct {
	client netip.AddrPort
	to     netip.AddrPort // guest address the socket is connected to
	guest  *net.UDPConn
	rc     syscall.RawConn

	last    atomic.Int64 // unix nanos of the latest datagram either way
	replied atomic.Bool  // the guest has answered at least once

	unrepliedIdle, repliedIdle time.Duration
}

func (s *session) touch() { s.last.Store(time.Now().UnixNano()) }

// expiry is when the session dies if nothing else moves: soon while the guest
// has never answered, later once it is a real conversation.
func (s *session) expiry() time.Time {
	idle := s.unrepliedIdle
	if s.replied.Load() {
		idle = s.repliedIdle
	}
	return time.Unix(0, s.last.Load()).Add(idle)
}

// serveUDP reads client datagrams for one binding until its socket closes.
func (p *Proxy) serveUDP(ex *exposure, b *binding) {
	defer p.wg.Done()
	rc, err := b.pc.SyscallConn()
	if err != nil {
		reason := err.Error()
		b.dead.Store(&reason)
		return
	}
	full := false // inside a streak of refusals at the cap
	for {
		buf, n, from, err := recvFrom(rc)
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			if transientRecv(err) {
				continue
			}
			reason := err.Error()
			b.dead.Store(&reason)
			b.pc.Close()
			p.log.Warn("exposure socket failed", "exposure", ex.id, "err", err)
			return
		}
		p.forward(ex, b, (*buf)[:n], from, &full)
		bufPool.Put(buf)
	}
}

// transientRecv: errors a UDP socket reports about a past datagram (ICMP
// feedback) or momentary pressure, none of which mean the socket is done.
func transientRecv(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH) ||
		errors.Is(err, syscall.ENETUNREACH) || errors.Is(err, syscall.ENOBUFS) ||
		errors.Is(err, syscall.ENOMEM)
}

// forward sends one client datagram to the guest through the client's
// session, opening one if needed.
func (p *Proxy) forward(ex *exposure, b *binding, data []byte, from netip.AddrPort, full *bool) {
	b.smu.Lock()
	s := b.sessions[from]
	b.smu.Unlock()
	if s == nil {
		if s = p.openSession(ex, b, from, full); s == nil {
			return
		}
	}
	s.touch()
	if _, err := s.guest.Write(data); err != nil {
		ex.dropped.Add(1)
		p.log.Debug("exposure dropped a datagram, send to guest failed",
			"exposure", ex.id, "client", from, "guest", s.to, "err", err)
		p.endSession(ex, b, s)
	}
}

// openSession makes a session for a new client, or returns nil when the
// datagram that asked for it is to be discarded. A full table is this
// exposure's own limit and counts as refused; everything else (no guest
// address, no socket) is the guest being unreachable and counts as dropped.
func (p *Proxy) openSession(ex *exposure, b *binding, from netip.AddrPort, full *bool) *session {
	t := ex.tgt.Load()
	// Only this goroutine adds sessions, so a count taken here can only be
	// too high (a session expiring meanwhile), never let the table overfill.
	b.smu.Lock()
	n := len(b.sessions)
	b.smu.Unlock()
	if n >= t.max {
		ex.refused.Add(1)
		p.log.Debug("exposure refused a session at its cap", "exposure", ex.id, "cap", t.max, "client", from)
		if !*full {
			*full = true
			p.log.Warn("exposure at its UDP session cap, discarding new clients",
				"exposure", ex.id, "cap", t.max)
		}
		return nil
	}
	*full = false

	ip, ok := p.cfg.Resolve(t.vmID)
	if !ok {
		ex.dropped.Add(1)
		p.log.Debug("exposure dropped a datagram, guest has no address",
			"exposure", ex.id, "vm", t.vmID, "client", from)
		return nil
	}
	to := netip.AddrPortFrom(ip, t.port)
	g, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
	if err != nil {
		ex.dropped.Add(1)
		p.log.Debug("exposure dropped a datagram, no socket toward guest",
			"exposure", ex.id, "guest", to, "client", from, "err", err)
		return nil
	}
	rc, err := g.SyscallConn()
	if err != nil {
		g.Close()
		ex.dropped.Add(1)
		return nil
	}
	s := &session{client: from, to: to, guest: g, rc: rc,
		unrepliedIdle: p.cfg.UnrepliedIdle, repliedIdle: p.cfg.RepliedIdle}
	s.touch()

	b.smu.Lock()
	if b.sessions == nil { // binding already torn down
		b.smu.Unlock()
		g.Close()
		return nil
	}
	b.sessions[from] = s
	ex.active.Add(1)
	b.smu.Unlock()

	p.log.Debug("exposure session opened", "exposure", ex.id, "client", from, "guest", to)
	p.wg.Add(1)
	go p.relay(ex, b, s)
	return s
}

// relay carries the guest's replies back to the client until the session goes
// idle or is ended. The idle clock is the read deadline; the forward direction
// only moves s.last, and a deadline that fires early is re-armed against it.
func (p *Proxy) relay(ex *exposure, b *binding, s *session) {
	defer p.wg.Done()
	defer p.endSession(ex, b, s)
	for {
		if err := s.guest.SetReadDeadline(s.expiry()); err != nil {
			return
		}
		buf, n, _, err := recvFrom(s.rc)
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				if time.Now().Before(s.expiry()) {
					continue
				}
				p.log.Debug("exposure session idle", "exposure", ex.id, "client", s.client,
					"replied", s.replied.Load())
				return
			}
			if errors.Is(err, syscall.ECONNREFUSED) {
				// ICMP port unreachable: the datagram reached the guest and
				// nothing there took it.
				ex.dropped.Add(1)
				p.log.Debug("exposure dropped a datagram, guest port closed",
					"exposure", ex.id, "client", s.client, "guest", s.to)
			}
			return
		}
		s.replied.Store(true)
		s.touch()
		_, werr := b.pc.WriteToUDPAddrPort((*buf)[:n], s.client)
		bufPool.Put(buf)
		if werr != nil && errors.Is(werr, net.ErrClosed) {
			return
		}
	}
}

// endSession removes s from its table (if still there) and closes its socket.
// Safe to call more than once and from either direction.
func (p *Proxy) endSession(ex *exposure, b *binding, s *session) {
	b.smu.Lock()
	removed := b.sessions[s.client] == s
	if removed {
		delete(b.sessions, s.client)
		ex.active.Add(-1)
	}
	b.smu.Unlock()
	s.guest.Close()
	if removed {
		p.log.Debug("exposure session closed", "exposure", ex.id, "client", s.client)
	}
}

// evictMoved ends sessions connected to an address the guest no longer has,
// or to a guest port the exposure no longer targets: their replies would come
// from nowhere, and the client's next datagram opens a session to the right
// place.
func (p *Proxy) evictMoved(ex *exposure, b *binding) {
	t := ex.tgt.Load()
	ip, ok := p.cfg.Resolve(t.vmID)
	want := netip.AddrPortFrom(ip, t.port)
	b.smu.Lock()
	var moved []*session
	for k, s := range b.sessions {
		if !ok || s.to != want {
			delete(b.sessions, k)
			ex.active.Add(-1)
			moved = append(moved, s)
		}
	}
	b.smu.Unlock()
	for _, s := range moved {
		s.guest.Close()
		p.log.Debug("exposure session closed, guest moved", "exposure", ex.id,
			"client", s.client, "from", s.to, "to", want)
	}
}

// evictAll ends every session of a binding being torn down.
func (p *Proxy) evictAll(ex *exposure, b *binding) {
	b.smu.Lock()
	all := b.sessions
	b.sessions = nil
	ex.active.Add(-int64(len(all)))
	b.smu.Unlock()
	for _, s := range all {
		s.guest.Close()
	}
}
