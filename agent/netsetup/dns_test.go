package netsetup

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/netnstest"
)

func TestParseUpstream(t *testing.T) {
	tests := []struct {
		in, want string
	}{
		{"192.0.2.1", "192.0.2.1:53"},
		{"192.0.2.1:5353", "192.0.2.1:5353"},
		{"2001:db8::1", "[2001:db8::1]:53"},
		{"[2001:db8::1]:54", "[2001:db8::1]:54"},
		{" 127.0.0.53 ", "127.0.0.53:53"},
	}
	for _, tc := range tests {
		got, err := ParseUpstream(tc.in)
		require.NoError(t, err, tc.in)
		assert.Equal(t, tc.want, got.String())
	}
	for _, bad := range []string{"", "resolver.example", "192.0.2.1:x", "1.2.3.4.5"} {
		_, err := ParseUpstream(bad)
		assert.Error(t, err, bad)
	}
}

// The host's resolvers are read from resolv.conf as it changes, loopback
// ones included (the forwarder runs on the host, where they answer), but
// never the forwarder itself.
func TestForwarderReadsTheHostsResolvers(t *testing.T) {
	path := filepath.Join(t.TempDir(), "resolv.conf")
	require.NoError(t, os.WriteFile(path, []byte("# systemd-resolved\nnameserver 127.0.0.53\nnameserver 10.77.0.1\noptions edns0\n"), 0o644))
	f := newDNSForwarder(netip.MustParseAddrPort("10.77.0.1:53"), nil, path, func(netip.Addr) bool { return true }, slog.New(slog.DiscardHandler))
	assert.Equal(t, []netip.AddrPort{netip.MustParseAddrPort("127.0.0.53:53")}, f.upstreams())

	require.NoError(t, os.WriteFile(path, []byte("nameserver 192.0.2.53\nnameserver 2001:db8::53\n"), 0o644))
	assert.Equal(t, []netip.AddrPort{netip.MustParseAddrPort("192.0.2.53:53"), netip.MustParseAddrPort("[2001:db8::53]:53")}, f.upstreams())

	fixed := newDNSForwarder(netip.MustParseAddrPort("10.77.0.1:53"), []netip.AddrPort{netip.MustParseAddrPort("192.0.2.9:5353")}, path, nil, slog.New(slog.DiscardHandler))
	assert.Equal(t, []netip.AddrPort{netip.MustParseAddrPort("192.0.2.9:5353")}, fixed.upstreams(), "configured upstreams win")
}

// guestNS moves the guest end of a veth into a namespace of its own with
// addr on it, so its traffic reaches the bridge as a guest's does (from
// the host's own namespace it would be local, and masqueraded), and
// returns a function that runs fn on a thread inside it. Sockets belong to
// the namespace of the thread that opens them; fn must open its own.
func guestNS(t *testing.T, link string, addr netip.Addr) func(fn func()) {
	t.Helper()
	runtime.LockOSThread()
	orig, err := netns.Get()
	require.NoError(t, err)
	ns, err := netns.New()
	require.NoError(t, netns.Set(orig))
	runtime.UnlockOSThread()
	require.NoError(t, err)
	t.Cleanup(func() { ns.Close(); orig.Close() })

	l, err := netlink.LinkByName(link)
	require.NoError(t, err)
	require.NoError(t, netlink.LinkSetNsFd(l, int(ns)))
	h, err := netlink.NewHandleAt(ns)
	require.NoError(t, err)
	defer h.Close()
	l, err = h.LinkByName(link)
	require.NoError(t, err)
	require.NoError(t, h.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: addr.AsSlice(), Mask: net.CIDRMask(24, 32)}}))
	require.NoError(t, h.LinkSetUp(l))
	return func(fn func()) {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		require.NoError(t, netns.Set(ns))
		defer func() { require.NoError(t, netns.Set(orig)) }()
		fn()
	}
}

// guestOnBridge sets up the network with cfg, leases vm-1 (owner alice)
// and vm-2 (bob) and puts vm-1's guest on the bridge. It returns the
// network and a function that runs fn as that guest (see guestNS).
func guestOnBridge(t *testing.T, cfg Config) (*Network, func(fn func())) {
	t.Helper()
	n, err := Setup(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(func() { n.Close() })
	addr1, err := n.Allocate("vm-1", MAC("vm-1"), "alice")
	require.NoError(t, err)
	_, err = n.Allocate("vm-2", MAC("vm-2"), "bob")
	require.NoError(t, err)
	guestPort(t, DefaultBridge, TapName("vm-1"), "vm1", MAC("vm-1"))
	return n, guestNS(t, "g-vm1", addr1)
}

// guestHTTP sends req from the guest to the endpoint on the gateway gw,
// and returns the answer's status and body.
func guestHTTP(t *testing.T, inGuest func(fn func()), gw netip.Addr, req *http.Request) (status int, body string) {
	t.Helper()
	inGuest(func() {
		c, err := net.DialTimeout("tcp", netip.AddrPortFrom(gw, DefaultPhoneHomePort).String(), 2*time.Second)
		require.NoError(t, err)
		defer c.Close()
		require.NoError(t, req.Write(c))
		resp, err := http.ReadResponse(bufio.NewReader(c), req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		status, body = resp.StatusCode, string(b)
	})
	return status, body
}

// A guest on the bridge resolves through the forwarder on the gateway and
// phones home there; nothing else gets an answer, and no guest can phone
// home for another.
func TestGuestsResolveAndPhoneHomeOnTheBridge(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		ctx := context.Background()
		linkUp(t, "lo")
		want := netip.MustParseAddr("192.0.2.7")
		upstream := netnstest.ServeName(t, "probe.eitri.test", want)
		leaseFile := filepath.Join(t.TempDir(), "leases.json")
		cfg := Config{LeaseFile: leaseFile, DNSUpstreams: []netip.AddrPort{upstream}, Log: hosttest.Logger(t)}
		n, inGuest := guestOnBridge(t, cfg)
		gw := n.Gateway()

		server := netip.AddrPortFrom(gw, 53).String()
		ask := func(netw string) (*dns.Msg, error) {
			c := &dns.Client{Net: netw, Timeout: 2 * time.Second}
			q := new(dns.Msg).SetQuestion("probe.eitri.test.", dns.TypeA)
			r, _, err := c.Exchange(q, server)
			return r, err
		}
		var err error
		for _, netw := range []string{"udp", "tcp"} {
			var r *dns.Msg
			inGuest(func() { r, err = ask(netw) })
			require.NoError(t, err, netw)
			require.Len(t, r.Answer, 1, netw)
			assert.Equal(t, want.String(), r.Answer[0].(*dns.A).A.String(), netw)
		}
		// Anything that holds no lease (here the host itself) is ignored.
		_, err = ask("udp")
		assert.Error(t, err, "the forwarder must not answer a non-guest")

		// Phone home: the VM's own URL from its own address counts.
		_, ok := n.PhonedHomeAt("vm-1")
		assert.False(t, ok)
		post := func(url string) int {
			req, err := http.NewRequest(http.MethodPost, url, strings.NewReader("instance_id=vm-1"))
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
			status, _ := guestHTTP(t, inGuest, gw, req)
			return status
		}
		url1 := n.PhoneHomeURL("vm-1")
		require.True(t, strings.HasPrefix(url1, "http://10.77.0.1:7480/"), url1)
		assert.Equal(t, http.StatusNotFound, post(url1[:len(url1)-1]+"x"), "a wrong token")
		assert.Equal(t, http.StatusNotFound, post(n.PhoneHomeURL("vm-2")), "vm-2's URL from vm-1's address")
		_, ok = n.PhonedHomeAt("vm-2")
		assert.False(t, ok)
		before := time.Now()
		assert.Equal(t, http.StatusOK, post(url1))
		at, ok := n.PhonedHomeAt("vm-1")
		require.True(t, ok)
		assert.False(t, at.Before(before.Add(-time.Second)))

		// The phone home outlives an agent restart; the URL stays the same.
		require.NoError(t, n.Close())
		n, err = Setup(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(func() { n.Close() })
		again, ok := n.PhonedHomeAt("vm-1")
		require.True(t, ok)
		assert.True(t, at.Equal(again))
		assert.Equal(t, url1, n.PhoneHomeURL("vm-1"))
	})
}
