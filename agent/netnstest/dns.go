package netnstest

import (
	"net"
	"net/netip"
	"strconv"
	"strings"
	"testing"

	"github.com/miekg/dns"
	"github.com/stretchr/testify/require"
)

// ServeName runs an authoritative DNS server on loopback (UDP and TCP, one
// port) that knows name (its A record is addr) and nothing else, standing in
// for the host's resolver: loopback, like systemd-resolved's, which no guest
// could reach itself. Other names get NXDOMAIN; other types of name, no
// answer.
func ServeName(t *testing.T, name string, addr netip.Addr) netip.AddrPort {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	port := pc.LocalAddr().(*net.UDPAddr).Port
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	require.NoError(t, err)
	h := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		switch {
		case len(r.Question) != 1 || !strings.EqualFold(r.Question[0].Name, dns.Fqdn(name)):
			m.SetRcode(r, dns.RcodeNameError)
		case r.Question[0].Qtype == dns.TypeA:
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: r.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: addr.AsSlice()})
		}
		_ = w.WriteMsg(m)
	})
	for _, s := range []*dns.Server{{PacketConn: pc, Handler: h}, {Listener: ln, Handler: h}} {
		go func() { _ = s.ActivateAndServe() }()
		t.Cleanup(func() { _ = s.Shutdown() })
	}
	return netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), uint16(port))
}
