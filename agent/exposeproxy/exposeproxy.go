// Package exposeproxy forwards published host ports to guest ports in
// userspace, over TCP and UDP, and counts what each published port carries.
//
// The caller hands Converge the complete list of exposures this host should
// serve; the proxy binds what is missing, keeps what is already bound and
// closes what is gone. Each exposure reports active (open connections or
// live sessions), refused (turned away at the exposure's own cap), dropped
// (could not be carried to the guest) and the bytes carried each way. All but
// active are running totals for the life of the exposure on this proxy.
package exposeproxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Protocol is the transport an exposure forwards.
type Protocol string

const (
	TCP Protocol = "tcp"
	UDP Protocol = "udp"
)

// State is what an exposure reports about its socket.
type State string

const (
	// StateActive: the host port is bound and forwarding.
	StateActive State = "active"
	// StateFailed: the host port could not be bound; Reason says why. The bind
	// is retried on the next Converge.
	StateFailed State = "failed"
)

// Spec is one desired exposure: a host address and port forwarded to a port
// on a VM's current address.
type Spec struct {
	ID        string
	VMID      string
	Protocol  Protocol
	Listen    netip.AddrPort // port 0 picks a free port (see Status.Bound)
	GuestPort uint16
	// MaxSessions caps concurrent TCP connections or UDP sessions for this
	// exposure; zero means the Config default for the protocol.
	MaxSessions int
}

// Status is what one exposure reports.
type Status struct {
	ID     string
	State  State
	Reason string
	// Bound is the address actually held; differs from Spec.Listen when the
	// spec asked for port 0. Invalid while the exposure is failed.
	Bound netip.AddrPort
	// Active is a gauge: open TCP connections or live UDP sessions.
	Active int64
	// Refused and Dropped are totals since this proxy first saw the exposure.
	Refused int64
	Dropped int64
	// BytesIn (caller to guest) and BytesOut (guest to caller) are payload
	// totals since this proxy first saw the exposure: the TCP stream, or the
	// UDP datagrams' payloads. Counted as the bytes are handed on, so a
	// datagram that is dropped adds nothing.
	BytesIn  int64
	BytesOut int64
}

// Resolver returns a VM's current guest address, or false while it has none
// (still leasing, stopped). It is called once per new connection or session,
// so it should be a cheap lookup.
type Resolver func(vmID string) (netip.Addr, bool)

// Config holds the proxy's dependencies and defaults. Zero values pick the
// defaults noted on each field.
type Config struct {
	Log     *slog.Logger // default slog.Default()
	Resolve Resolver     // required; nil resolves nothing (every caller dropped)

	MaxConns    int // default TCP connection cap per exposure: 1024
	MaxSessions int // default UDP session cap per exposure: 1024

	// A UDP session the guest has never answered expires after
	// UnrepliedIdle; once answered, after RepliedIdle without traffic either
	// way. Mirrors conntrack's unreplied/stream split: a one-way flood should
	// not hold table slots as long as a real conversation. Defaults 30s, 2m.
	UnrepliedIdle time.Duration
	RepliedIdle   time.Duration

	DialTimeout time.Duration // TCP dial to the guest; default 5s
}

const (
	defaultCap           = 1024
	defaultUnrepliedIdle = 30 * time.Second
	defaultRepliedIdle   = 2 * time.Minute
	defaultDialTimeout   = 5 * time.Second
)

// Proxy owns every published port of one host.
type Proxy struct {
	cfg Config
	log *slog.Logger

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// sleep waits out an accept backoff; a field so a test can record the
	// backoff sequence instead of sleeping through it. Returns false when the
	// proxy is closing.
	sleep func(ctx context.Context, d time.Duration) bool
	// now is the clock that spaces out repeated warnings; a field for tests.
	now func() time.Time

	mu        sync.Mutex
	closed    bool
	exposures map[string]*exposure
}

// New returns a proxy holding no ports.
func New(cfg Config) *Proxy {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Resolve == nil {
		cfg.Resolve = func(string) (netip.Addr, bool) { return netip.Addr{}, false }
	}
	if cfg.MaxConns <= 0 {
		cfg.MaxConns = defaultCap
	}
	if cfg.MaxSessions <= 0 {
		cfg.MaxSessions = defaultCap
	}
	if cfg.UnrepliedIdle <= 0 {
		cfg.UnrepliedIdle = defaultUnrepliedIdle
	}
	if cfg.RepliedIdle <= 0 {
		cfg.RepliedIdle = defaultRepliedIdle
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = defaultDialTimeout
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Proxy{
		cfg:       cfg,
		log:       cfg.Log,
		ctx:       ctx,
		cancel:    cancel,
		sleep:     sleepCtx,
		now:       time.Now,
		exposures: make(map[string]*exposure),
	}
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// target is where an exposure forwards to. Swapped whole so a change of VM,
// guest port or cap takes effect for the next caller without a rebind.
type target struct {
	vmID string
	port uint16
	max  int
}

// exposure is one published port's entry. It outlives its sockets: a rebind
// (new listen address, a listener that died) keeps the entry and so keeps the
// totals; only leaving the desired list, or a new Proxy, starts them over.
type exposure struct {
	id  string
	tgt atomic.Pointer[target]

	active   atomic.Int64
	refused  atomic.Int64
	dropped  atomic.Int64
	bytesIn  atomic.Int64
	bytesOut atomic.Int64

	// Guarded by Proxy.mu.
	spec   Spec
	reason string
	b      *binding

	// conns are the TCP client halves in flight, so removing the exposure can
	// end them. gone refuses late arrivals from an accept loop mid-flight.
	cmu   sync.Mutex
	gone  bool
	conns map[*net.TCPConn]struct{}
}

// binding is one bound socket of an exposure and what depends on it. UDP
// sessions live here because replies leave through this socket.
type binding struct {
	ln   *net.TCPListener
	pc   *net.UDPConn
	prc  syscall.RawConn // pc's, for batched reads and the replies sent through it
	addr netip.AddrPort
	// dead holds the reason a serve loop gave up on a socket it did not
	// expect to lose; the next Converge rebinds.
	dead atomic.Pointer[string]

	smu      sync.Mutex
	sessions map[netip.AddrPort]*session
}

// Converge makes the set of served exposures equal specs and reports every
// desired exposure, in the order given. It is level-triggered: calling it
// again with the same list changes nothing but retries failed binds and
// evicts UDP sessions pointing at a guest's old address.
func (p *Proxy) Converge(specs []Spec) []Status {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	want := make(map[string]struct{}, len(specs))
	out := make([]Status, 0, len(specs))
	for _, s := range specs {
		if _, dup := want[s.ID]; dup {
			continue // first one wins; a duplicate id cannot be two ports
		}
		want[s.ID] = struct{}{}
		ex := p.exposures[s.ID]
		if ex == nil {
			ex = &exposure{id: s.ID, conns: make(map[*net.TCPConn]struct{})}
			p.exposures[s.ID] = ex
		}
		ex.tgt.Store(&target{vmID: s.VMID, port: s.GuestPort, max: p.capFor(s)})
		if ex.b != nil {
			if dead := ex.b.dead.Load(); dead != nil {
				p.log.Warn("exposure socket lost, rebinding", "exposure", s.ID, "reason", *dead)
				p.unbind(ex)
			} else if ex.spec.Protocol != s.Protocol || ex.spec.Listen != s.Listen {
				p.log.Info("exposure moved, rebinding", "exposure", s.ID,
					"from", ex.spec.Listen, "to", s.Listen, "protocol", s.Protocol)
				p.unbind(ex)
			}
		}
		ex.spec = s
		if ex.b == nil {
			if err := p.bind(ex); err != nil {
				if ex.reason != err.Error() {
					p.log.Warn("exposure bind failed", "exposure", s.ID, "listen", s.Listen, "err", err)
				}
				ex.reason = err.Error()
				out = append(out, ex.status())
				continue
			}
			ex.reason = ""
			p.log.Debug("exposure bound", "exposure", s.ID, "listen", ex.b.addr, "protocol", s.Protocol)
		}
		if ex.b.pc != nil {
			p.evictMoved(ex, ex.b)
		}
		out = append(out, ex.status())
	}
	for id, ex := range p.exposures {
		if _, ok := want[id]; ok {
			continue
		}
		p.unbind(ex)
		ex.closeConns()
		delete(p.exposures, id)
		p.log.Debug("exposure removed", "exposure", id)
	}
	return out
}

// Status reports every exposure the proxy holds, sorted by id, without
// changing anything.
func (p *Proxy) Status() []Status {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]Status, 0, len(p.exposures))
	for _, ex := range p.exposures {
		out = append(out, ex.status())
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// Close releases every port and ends every connection and session, and
// returns once all of the proxy's goroutines have exited.
func (p *Proxy) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	for id, ex := range p.exposures {
		p.unbind(ex)
		ex.closeConns()
		delete(p.exposures, id)
	}
	p.cancel()
	p.mu.Unlock()
	p.wg.Wait()
}

// status is the exposure's report; the caller holds Proxy.mu.
func (ex *exposure) status() Status {
	st := Status{
		ID:       ex.id,
		State:    StateFailed,
		Reason:   ex.reason,
		Active:   ex.active.Load(),
		Refused:  ex.refused.Load(),
		Dropped:  ex.dropped.Load(),
		BytesIn:  ex.bytesIn.Load(),
		BytesOut: ex.bytesOut.Load(),
	}
	if ex.b != nil {
		st.State = StateActive
		st.Bound = ex.b.addr
		if dead := ex.b.dead.Load(); dead != nil {
			st.State, st.Reason = StateFailed, *dead
		}
	}
	return st
}

func (p *Proxy) capFor(s Spec) int {
	switch {
	case s.MaxSessions > 0:
		return s.MaxSessions
	case s.Protocol == UDP:
		return p.cfg.MaxSessions
	default:
		return p.cfg.MaxConns
	}
}

// bind opens the exposure's socket and starts its serve loop; the caller holds
// Proxy.mu.
func (p *Proxy) bind(ex *exposure) error {
	s := ex.spec
	if !s.Listen.IsValid() {
		return fmt.Errorf("invalid listen address %q", s.Listen)
	}
	if s.GuestPort == 0 {
		return errors.New("guest port is 0")
	}
	switch s.Protocol {
	case TCP:
		ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(s.Listen))
		if err != nil {
			return err
		}
		b := &binding{ln: ln, addr: ln.Addr().(*net.TCPAddr).AddrPort()}
		ex.b = b
		p.wg.Add(1)
		go p.serveTCP(ex, b, ln)
	case UDP:
		pc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(s.Listen))
		if err != nil {
			return err
		}
		prc, err := pc.SyscallConn()
		if err != nil {
			pc.Close()
			return err
		}
		b := &binding{pc: pc, prc: prc, addr: pc.LocalAddr().(*net.UDPAddr).AddrPort(),
			sessions: make(map[netip.AddrPort]*session)}
		ex.b = b
		p.wg.Add(1)
		go p.serveUDP(ex, b)
	default:
		return fmt.Errorf("unknown protocol %q", s.Protocol)
	}
	return nil
}

// unbind closes the exposure's socket, and its UDP sessions with it. TCP
// connections already piped are left alone: they do not depend on the
// listener. The caller holds Proxy.mu.
func (p *Proxy) unbind(ex *exposure) {
	b := ex.b
	if b == nil {
		return
	}
	ex.b = nil
	if b.ln != nil {
		b.ln.Close()
	}
	if b.pc != nil {
		b.pc.Close()
		p.evictAll(ex, b)
	}
}

// track records an accepted connection; false means the exposure is gone and
// the caller must close it.
func (ex *exposure) track(c *net.TCPConn) bool {
	ex.cmu.Lock()
	defer ex.cmu.Unlock()
	if ex.gone {
		return false
	}
	ex.conns[c] = struct{}{}
	return true
}

func (ex *exposure) untrack(c *net.TCPConn) {
	ex.cmu.Lock()
	delete(ex.conns, c)
	ex.cmu.Unlock()
}

// closeConns ends every TCP connection of a removed exposure. Closing the
// client half is enough: the pipe tears the guest half down when its copy
// fails.
func (ex *exposure) closeConns() {
	ex.cmu.Lock()
	defer ex.cmu.Unlock()
	ex.gone = true
	for c := range ex.conns {
		c.Close()
	}
}
