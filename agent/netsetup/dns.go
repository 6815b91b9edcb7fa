package netsetup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// The guests' resolver is a forwarder on the bridge address: the host's own
// resolvers are often loopback (systemd-resolved's 127.0.0.53), which no
// guest can reach, so the agent relays for them. It answers leased guests
// only and bounds what they can make it do: in-flight lookups, time per
// lookup, message size.
const (
	// DefaultResolvConf is where the host's resolvers are read from when no
	// upstream is configured.
	DefaultResolvConf = "/etc/resolv.conf"

	dnsPort = 53
	// dnsMaxInFlight bounds lookups relayed at once for all guests; a query
	// beyond it is answered SERVFAIL at once rather than queued.
	dnsMaxInFlight = 64
	// dnsUpstreamTimeout bounds one upstream exchange; dnsLookupTimeout the
	// whole lookup across upstreams (a guest's resolver retries after ~5 s).
	dnsUpstreamTimeout = 2 * time.Second
	dnsLookupTimeout   = 4 * time.Second
	// dnsMaxUpstreams is how many upstreams one lookup tries.
	dnsMaxUpstreams = 3
	// dnsUDPSize is the largest UDP message read or relayed (EDNS0's usual
	// ceiling); TCP carries anything larger.
	dnsUDPSize = 4096
	// dnsMaxTCPQueries bounds queries on one guest TCP connection.
	dnsMaxTCPQueries = 16
)

// ParseUpstream reads one DNS upstream: an address, or address:port
// ([v6]:port). Port 53 is the default.
func ParseUpstream(s string) (netip.AddrPort, error) {
	s = strings.TrimSpace(s)
	if ap, err := netip.ParseAddrPort(s); err == nil {
		return ap, nil
	}
	a, err := netip.ParseAddr(strings.Trim(s, "[]"))
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("dns upstream %q: want an address or address:port", s)
	}
	return netip.AddrPortFrom(a, dnsPort), nil
}

// dnsForwarder relays guests' lookups to upstream resolvers.
type dnsForwarder struct {
	listen netip.AddrPort
	// fixed upstreams, or none to read resolvConf.
	fixed      []netip.AddrPort
	resolvConf string
	// allowed says whether a source address is a guest that may ask.
	allowed func(netip.Addr) bool
	log     *slog.Logger

	slots      chan struct{}
	udp, tcp   *dns.Server
	serveDone  sync.WaitGroup
	mu         sync.Mutex
	confMod    time.Time
	confSize   int64
	fromConf   []netip.AddrPort
	warnedNone bool
}

func newDNSForwarder(listen netip.AddrPort, fixed []netip.AddrPort, resolvConf string, allowed func(netip.Addr) bool, log *slog.Logger) *dnsForwarder {
	return &dnsForwarder{
		listen: listen, fixed: fixed, resolvConf: resolvConf, allowed: allowed,
		log: log, slots: make(chan struct{}, dnsMaxInFlight),
	}
}

// start binds UDP and TCP on the listen address, then serves in the
// background. Either bind failing is an error and nothing is left bound.
func (f *dnsForwarder) start() error {
	pc, err := net.ListenPacket("udp", f.listen.String())
	if err != nil {
		return fmt.Errorf("netsetup: dns on %s/udp: %w", f.listen, err)
	}
	ln, err := net.Listen("tcp", f.listen.String())
	if err != nil {
		pc.Close()
		return fmt.Errorf("netsetup: dns on %s/tcp: %w", f.listen, err)
	}
	common := func(s *dns.Server) *dns.Server {
		s.Handler = f
		s.UDPSize = dnsUDPSize
		s.ReadTimeout = 2 * time.Second
		s.WriteTimeout = 2 * time.Second
		s.IdleTimeout = func() time.Duration { return 5 * time.Second }
		s.MaxTCPQueries = dnsMaxTCPQueries
		return s
	}
	f.udp = common(&dns.Server{PacketConn: pc})
	f.tcp = common(&dns.Server{Listener: ln})
	// Shutdown before a server has started is refused and leaves it to
	// serve forever: return only once both have.
	var started sync.WaitGroup
	for _, s := range []*dns.Server{f.udp, f.tcp} {
		started.Add(1)
		up := sync.OnceFunc(started.Done)
		s.NotifyStartedFunc = up
		f.serveDone.Add(1)
		go func() {
			defer f.serveDone.Done()
			defer up() // a server that failed to start never will
			if err := s.ActivateAndServe(); err != nil {
				f.log.Debug("dns server stopped", "err", err)
			}
		}()
	}
	started.Wait()
	return nil
}

func (f *dnsForwarder) close() error {
	var errs []error
	for _, s := range []*dns.Server{f.udp, f.tcp} {
		if s != nil {
			errs = append(errs, s.Shutdown())
		}
	}
	f.serveDone.Wait()
	return errors.Join(errs...)
}

// upstreams is the configured list, or the host's resolv.conf as it is now
// (re-read when it changes), never naming the forwarder itself.
func (f *dnsForwarder) upstreams() []netip.AddrPort {
	if len(f.fixed) > 0 {
		return f.fixed
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	fi, err := os.Stat(f.resolvConf)
	if err == nil && (!fi.ModTime().Equal(f.confMod) || fi.Size() != f.confSize) {
		f.confMod, f.confSize = fi.ModTime(), fi.Size()
		f.fromConf = f.readResolvConf()
	}
	if len(f.fromConf) == 0 && !f.warnedNone {
		f.warnedNone = true
		f.log.Warn("dns: no upstream resolver (none in the resolv.conf, and none configured); guests' lookups fail", "resolv_conf", f.resolvConf)
	}
	return f.fromConf
}

func (f *dnsForwarder) readResolvConf() []netip.AddrPort {
	cc, err := dns.ClientConfigFromFile(f.resolvConf)
	if err != nil {
		f.log.Warn("dns: cannot read the host's resolvers", "resolv_conf", f.resolvConf, "err", err)
		return nil
	}
	port := dnsPort
	if p, err := strconv.Atoi(cc.Port); err == nil && p > 0 && p < 65536 {
		port = p
	}
	var out []netip.AddrPort
	for _, s := range cc.Servers {
		a, err := netip.ParseAddr(s)
		if err != nil {
			continue
		}
		ap := netip.AddrPortFrom(a, uint16(port))
		if ap == f.listen {
			continue // relaying to ourselves would loop
		}
		out = append(out, ap)
	}
	f.warnedNone = false
	f.log.Info("dns: upstream resolvers", "from", f.resolvConf, "upstreams", out)
	return out
}

// ServeDNS relays one query. A query from anything but a leased guest gets
// no answer at all: answering costs, and refusing tells a scanner the port
// is there.
func (f *dnsForwarder) ServeDNS(w dns.ResponseWriter, req *dns.Msg) {
	src, ok := addrOf(w.RemoteAddr())
	if !ok || !f.allowed(src) {
		if w.RemoteAddr().Network() == "tcp" {
			_ = w.Close()
		}
		return
	}
	select {
	case f.slots <- struct{}{}:
		defer func() { <-f.slots }()
	default:
		f.fail(w, req)
		return
	}
	netw := "udp"
	if w.RemoteAddr().Network() == "tcp" {
		netw = "tcp"
	}
	client := &dns.Client{Net: netw, Timeout: dnsUpstreamTimeout, UDPSize: dnsUDPSize}
	ctx, cancel := context.WithTimeout(context.Background(), dnsLookupTimeout)
	defer cancel()
	ups := f.upstreams()
	for i, up := range ups {
		if i == dnsMaxUpstreams || ctx.Err() != nil {
			break
		}
		resp, _, err := client.ExchangeContext(ctx, req, up.String())
		if err != nil {
			f.log.Debug("dns: upstream failed", "upstream", up, "err", err)
			continue
		}
		if netw == "udp" {
			// The upstream answered a resolver whose size limit the guest
			// set; one that set none gets the classic 512 bytes, truncated
			// (TC) so it retries over TCP.
			size := dns.MinMsgSize
			if o := req.IsEdns0(); o != nil {
				size = min(int(o.UDPSize()), dnsUDPSize)
			}
			resp.Truncate(size)
		}
		_ = w.WriteMsg(resp)
		return
	}
	f.fail(w, req)
}

func (f *dnsForwarder) fail(w dns.ResponseWriter, req *dns.Msg) {
	m := new(dns.Msg)
	m.SetRcode(req, dns.RcodeServerFailure)
	_ = w.WriteMsg(m)
}

func addrOf(a net.Addr) (netip.Addr, bool) {
	switch a := a.(type) {
	case *net.UDPAddr:
		ap := a.AddrPort()
		return ap.Addr().Unmap(), ap.IsValid()
	case *net.TCPAddr:
		ap := a.AddrPort()
		return ap.Addr().Unmap(), ap.IsValid()
	}
	return netip.Addr{}, false
}

// startDNS runs the forwarder on the bridge address and announces it. The
// port being taken there (another resolver on the host bound to every
// address) is no reason to fail the network: guests are then told the
// host's resolvers they can reach, if any, as before there was a forwarder.
func (n *Network) startDNS() error {
	if len(n.cfg.DNS) > 0 {
		n.announce = ipv4Only(n.cfg.DNS)
		return nil
	}
	f := newDNSForwarder(netip.AddrPortFrom(n.pool.gateway, dnsPort), n.cfg.DNSUpstreams, n.cfg.ResolvConf, n.isGuest, n.log)
	if err := f.start(); err != nil {
		var direct []netip.Addr
		for _, up := range f.upstreams() {
			if a := up.Addr().Unmap(); up.Port() == dnsPort && a.Is4() && !a.IsLoopback() && !a.IsLinkLocalUnicast() {
				direct = append(direct, a)
			}
		}
		n.announce = direct
		n.log.Warn("no DNS forwarder for guests; announcing the host's reachable resolvers instead", "err", err, "dns", direct)
		return nil
	}
	n.dns, n.announce = f, []netip.Addr{n.pool.gateway}
	return nil
}

// isGuest says whether a holds a lease: only guests may use the forwarder.
func (n *Network) isGuest(a netip.Addr) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.byAddr(a) != nil
}

// ipv4Only keeps what DHCPv4's resolver option can carry.
func ipv4Only(as []netip.Addr) []netip.Addr {
	var out []netip.Addr
	for _, a := range as {
		if a = a.Unmap(); a.Is4() {
			out = append(out, a)
		}
	}
	return out
}
