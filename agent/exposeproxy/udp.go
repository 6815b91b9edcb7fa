package exposeproxy

import (
	"errors"
	"net"
	"net/netip"
	"os"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// session is one client's conversation with the guest: its own connected
// socket toward the guest, so replies can be told apart by socket rather than
// by guest source port.
type session struct {
	client netip.AddrPort
	// name is the client's address as the kernel reported it, so replies go
	// back to exactly that (IPv6 scope included).
	name    unix.RawSockaddrInet6
	namelen uint32
	to      netip.AddrPort // guest address the socket is connected to
	guest   *net.UDPConn
	rc      syscall.RawConn

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
	r := newReader(b.prc)
	defer r.release()
	var full streak // refusals at the cap
	for {
		bt, err := r.read()
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
		for _, g := range bt.group() {
			p.forward(ex, b, bt, g, &full)
		}
	}
}

// transientRecv: errors a UDP socket reports about a past datagram (ICMP
// feedback) or momentary pressure, none of which mean the socket is done.
func transientRecv(err error) bool {
	return errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.EHOSTUNREACH) ||
		errors.Is(err, syscall.ENETUNREACH) || errors.Is(err, syscall.ENOBUFS) ||
		errors.Is(err, syscall.ENOMEM)
}

// forward sends one client's datagrams of a batch to the guest, in the order
// they came, through the client's session, opening one if needed. Each
// datagram is either sent or counted (refused or dropped).
func (p *Proxy) forward(ex *exposure, b *binding, bt *batch, g *group, full *streak) {
	for i := 0; i < g.n; {
		s := b.lookup(g.from)
		for s == nil && i < g.n {
			k := g.idx[i]
			if s = p.openSession(ex, b, g.from, &bt.names[k], bt.rhs[k].Hdr.Namelen, full); s == nil {
				i++ // this datagram was refused or dropped, and counted so
			}
		}
		if s == nil {
			return
		}
		s.touch()
		out := &bt.out
		out.reset()
		for _, k := range g.idx[i:g.n] {
			out.add(bt.data(int(k)), nil, 0)
		}
		sent, err := out.flush(s.rc)
		ex.bytesIn.Add(out.size(0, sent))
		i += sent
		if err == nil {
			return
		}
		if errors.Is(err, net.ErrClosed) {
			// The session ended meanwhile (idle, guest moved); it left the
			// table before its socket closed, so the rest open a new one.
			continue
		}
		ex.dropped.Add(1)
		p.log.Debug("exposure dropped a datagram, send to guest failed",
			"exposure", ex.id, "client", g.from, "guest", s.to, "err", err)
		p.endSession(ex, b, s)
		i++
	}
}

// group is one client's datagrams within a batch, in arrival order.
type group struct {
	from netip.AddrPort
	idx  [batchSize]uint8
	n    int
}

// group sorts the last read by client, keeping each client's order.
func (bt *batch) group() []*group {
	bt.gs = bt.gs[:0]
	for i := range bt.n {
		from := bt.from(i)
		var g *group
		for _, c := range bt.gs {
			if c.from == from {
				g = c
				break
			}
		}
		if g == nil {
			g = &bt.groups[len(bt.gs)]
			g.from, g.n = from, 0
			bt.gs = append(bt.gs, g)
		}
		g.idx[g.n] = uint8(i)
		g.n++
	}
	return bt.gs
}

// lookup returns the live session of a client, if any. The table is consulted
// once per client per batch, not per datagram.
func (b *binding) lookup(from netip.AddrPort) *session {
	b.smu.Lock()
	s := b.sessions[from]
	b.smu.Unlock()
	return s
}

// openSession makes a session for a new client, or returns nil when the
// datagram that asked for it is to be discarded. A full table is this
// exposure's own limit and counts as refused; everything else (no guest
// address, no socket) is the guest being unreachable and counts as dropped.
func (p *Proxy) openSession(ex *exposure, b *binding, from netip.AddrPort,
	name *unix.RawSockaddrInet6, namelen uint32, full *streak) *session {
	t := ex.tgt.Load()
	// Only this goroutine adds sessions, so a count taken here can only be
	// too high (a session expiring meanwhile), never let the table overfill.
	b.smu.Lock()
	n := len(b.sessions)
	b.smu.Unlock()
	if n >= t.max {
		ex.refused.Add(1)
		p.log.Debug("exposure refused a session at its cap", "exposure", ex.id, "cap", t.max, "client", from)
		if warn, unlogged := full.begin(p.now); warn {
			p.log.Warn("exposure at its UDP session cap, discarding new clients",
				"exposure", ex.id, "cap", t.max, "unlogged_streaks", unlogged)
		}
		return nil
	}
	full.end()

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
	s := &session{client: from, name: *name, namelen: namelen, to: to, guest: g, rc: rc,
		unrepliedIdle: p.cfg.UnrepliedIdle, repliedIdle: p.cfg.RepliedIdle}
	s.touch()

	b.smu.Lock()
	if b.sessions == nil { // binding torn down with this datagram in hand
		b.smu.Unlock()
		g.Close()
		ex.dropped.Add(1)
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
	r := newReader(s.rc)
	defer r.release()
	if err := s.guest.SetReadDeadline(s.expiry()); err != nil {
		return
	}
	for {
		bt, err := r.read()
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				if exp := s.expiry(); time.Now().Before(exp) {
					if s.guest.SetReadDeadline(exp) != nil {
						return
					}
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
		s.touch()
		if !s.replied.Load() {
			// Now the replied limit applies, which may be the shorter one.
			s.replied.Store(true)
			if s.guest.SetReadDeadline(s.expiry()) != nil {
				return
			}
		}
		out := &bt.out
		out.reset()
		for i := range bt.n {
			out.add(bt.data(i), &s.name, s.namelen)
		}
		for i := 0; i < out.n; {
			sent, err := out.flushFrom(b.prc, i)
			ex.bytesOut.Add(out.size(i, sent))
			if err == nil {
				break
			}
			if errors.Is(err, net.ErrClosed) {
				return
			}
			i = sent + 1 // a reply the client's address will not take is skipped
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
	}
	b.smu.Unlock()
	s.guest.Close()
	if removed {
		// Logged before the gauge drops, so whoever sees it drop can also
		// see why.
		p.log.Debug("exposure session closed", "exposure", ex.id, "client", s.client)
		ex.active.Add(-1)
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
