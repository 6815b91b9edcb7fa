package netsetup

import (
	"context"
	"net"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/google/nftables"
	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/a73x/eitri/agent/netnstest"
)

func TestPeerGroupsPairOnlyGuestsOfOneNonEmptyOwner(t *testing.T) {
	ports := []filterPort{
		{Tap: "eitri-d", Owner: "bob"},
		{Tap: "eitri-a", Owner: "alice"},
		{Tap: "eitri-x", Owner: ""},
		{Tap: "eitri-c", Owner: "alice"},
		{Tap: "eitri-y", Owner: ""},
		{Tap: "eitri-e", Owner: "carol"},
		{Tap: "eitri-b", Owner: "bob"},
	}
	assert.Equal(t, [][]string{{"eitri-a", "eitri-c"}, {"eitri-b", "eitri-d"}}, peerGroups(ports),
		"owners with one guest need no group; guests without an owner share none")
	assert.Empty(t, peerGroups(nil))
}

func TestGuestChainEndsInACountedDrop(t *testing.T) {
	p := filterPort{Tap: TapName("vm"), MAC: MAC("vm"), Addr: netip.MustParseAddr("10.77.0.2"), Owner: "alice"}
	rules := guestChain(p)
	last := rules[len(rules)-1]
	assert.Equal(t, counted(0)[0], last.exprs[0], "whatever nothing accepted is counted")
	assert.Equal(t, comment(commentSpoofed), last.comment)

	// Without an address only DHCP (and the checks before it) remains.
	p.Addr = netip.Addr{}
	assert.Len(t, guestChain(p), 4)
}

// filterGuest is one stand-in guest on the bridge: a VM's lease and tap,
// with the test holding the tap.
type filterGuest struct {
	id string
	*netnstest.TapGuest
}

func TestGuestFilterKeepsGuestsToTheirOwnAddressesAndOwners(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		ctx := context.Background()
		linkUp(t, "lo")
		leaseFile := filepath.Join(t.TempDir(), "leases.json")
		n, err := Setup(ctx, Config{LeaseFile: leaseFile, Log: hosttest.Logger(t)})
		require.NoError(t, err)
		t.Cleanup(func() { n.Close() })
		gw := n.Gateway()

		guest := func(id, owner string) filterGuest {
			addr, err := n.Allocate(id, MAC(id), owner)
			require.NoError(t, err)
			require.NoError(t, n.AddTap(TapName(id)))
			return filterGuest{id, netnstest.OpenTap(t, TapName(id), MAC(id), addr)}
		}
		a1 := guest("vm-a1", "alice")
		a2 := guest("vm-a2", "alice")
		b1 := guest("vm-b1", "bob")
		x := guest("vm-x", "") // from a control plane that sends no owner
		// Read only now: a bridge takes the lowest MAC of its ports.
		br, err := netlink.LinkByName(DefaultBridge)
		require.NoError(t, err)
		gwMAC := br.Attrs().HardwareAddr

		// The host listens on the gateway address as any service would.
		host, err := net.ListenUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(gw, 9999)))
		require.NoError(t, err)
		t.Cleanup(func() { host.Close() })
		hostGot := make(chan netip.Addr, 64)
		go func() {
			buf := make([]byte, 2048)
			for {
				_, from, err := host.ReadFromUDPAddrPort(buf)
				if err != nil {
					return
				}
				hostGot <- from.Addr().Unmap()
			}
		}()
		hostHears := func(from netip.Addr) bool {
			deadline := time.After(time.Second)
			for {
				select {
				case a := <-hostGot:
					if a == from {
						return true
					}
				case <-deadline:
					return false
				}
			}
		}

		// send writes a UDP datagram from the guest's tap; src is the
		// address it claims, mac the Ethernet source it claims.
		send := func(g filterGuest, mac net.HardwareAddr, src netip.Addr, dstMAC net.HardwareAddr, dst netip.Addr, tag string) {
			g.Send(t, netnstest.EthernetFrame(dstMAC, mac, netnstest.EtherTypeIPv4,
				netnstest.UDP4(netip.AddrPortFrom(src, 4000), netip.AddrPortFrom(dst, 9999), []byte(tag))))
		}
		tagged := func(tag string) func(netnstest.Frame) bool {
			return func(fr netnstest.Frame) bool { return fr.Proto == 17 && string(fr.Payload) == tag }
		}
		const quiet = 700 * time.Millisecond

		// Every guest reaches the gateway, and the host's answer comes back.
		for _, g := range []filterGuest{a1, a2, b1, x} {
			send(g, g.MAC, g.IP, gwMAC, gw, "hello gateway")
			assert.True(t, hostHears(g.IP), "%s reaches the gateway", g.id)
			_, err := host.WriteToUDPAddrPort([]byte("hello "+g.id), netip.AddrPortFrom(g.IP, 4000))
			require.NoError(t, err)
			_, ok := g.WaitFor(2*time.Second, tagged("hello "+g.id))
			assert.True(t, ok, "the host reaches %s", g.id)
		}

		// Same owner: through. Different owners, or no owner: dropped.
		send(a1, a1.MAC, a1.IP, a2.MAC, a2.IP, "a1 to a2")
		_, ok := a2.WaitFor(2*time.Second, tagged("a1 to a2"))
		assert.True(t, ok, "guests of one owner reach each other")
		before, err := n.FilterDrops()
		require.NoError(t, err)
		send(b1, b1.MAC, b1.IP, a1.MAC, a1.IP, "b1 to a1")
		send(a1, a1.MAC, a1.IP, b1.MAC, b1.IP, "a1 to b1")
		send(x, x.MAC, x.IP, a1.MAC, a1.IP, "x to a1")
		send(a1, a1.MAC, a1.IP, x.MAC, x.IP, "a1 to x")
		b1.Send(t, netnstest.EthernetFrame(netnstest.Broadcast, b1.MAC, netnstest.EtherTypeARP,
			netnstest.ARP(1, b1.MAC, b1.IP, nil, a1.IP)))
		_, ok = a1.WaitFor(quiet, func(fr netnstest.Frame) bool {
			return tagged("b1 to a1")(fr) || tagged("x to a1")(fr) || fr.Type == netnstest.EtherTypeARP && fr.SPA == b1.IP
		})
		assert.False(t, ok, "nothing from another owner's guest reaches a1, not even ARP")
		assert.Zero(t, b1.Count(tagged("a1 to b1")))
		assert.Zero(t, x.Count(tagged("a1 to x")))
		assert.Zero(t, a2.Count(func(fr netnstest.Frame) bool { return fr.Type == netnstest.EtherTypeARP && fr.SPA == b1.IP }))
		after, err := n.FilterDrops()
		require.NoError(t, err)
		assert.GreaterOrEqual(t, after.CrossOwner-before.CrossOwner, uint64(4+3), "four datagrams and the ARP broadcast's copies")

		// Routing through the gateway is no way around the owner check.
		send(b1, b1.MAC, b1.IP, gwMAC, a1.IP, "b1 via gateway")
		_, ok = a1.WaitFor(quiet, tagged("b1 via gateway"))
		assert.False(t, ok, "the host does not route guest to guest")
		after, err = n.FilterDrops()
		require.NoError(t, err)
		assert.Equal(t, uint64(1), after.Routed)

		// b1 poses as a1: its address from its own MAC, a1's MAC too, ARP
		// saying a1's address is at b1, DHCP in a1's name, IPv6.
		before = after
		send(b1, b1.MAC, a1.IP, gwMAC, gw, "spoofed address")
		send(b1, a1.MAC, a1.IP, gwMAC, gw, "spoofed address and MAC")
		send(b1, a1.MAC, a1.IP, a2.MAC, a2.IP, "spoofed to a2")
		b1.Send(t, netnstest.EthernetFrame(netnstest.Broadcast, b1.MAC, netnstest.EtherTypeARP,
			netnstest.ARP(2, b1.MAC, a1.IP, netnstest.Broadcast, a1.IP)))
		b1.Send(t, netnstest.EthernetFrame(gwMAC, b1.MAC, netnstest.EtherTypeARP,
			netnstest.ARP(1, b1.MAC, a1.IP, nil, gw)))
		b1.Send(t, netnstest.EthernetFrame(netnstest.Broadcast, a1.MAC, netnstest.EtherTypeARP,
			netnstest.ARP(2, a1.MAC, a1.IP, netnstest.Broadcast, a1.IP)))
		discover := func(g filterGuest, chaddr net.HardwareAddr) {
			d, err := dhcpv4.NewDiscovery(chaddr)
			require.NoError(t, err)
			g.Send(t, netnstest.EthernetFrame(netnstest.Broadcast, g.MAC, netnstest.EtherTypeIPv4,
				netnstest.UDP4(netip.MustParseAddrPort("0.0.0.0:68"), netip.MustParseAddrPort("255.255.255.255:67"), d.ToBytes())))
		}
		discover(b1, a1.MAC)
		linkLocal := netip.MustParseAddr("fe80::1")
		b1.Send(t, netnstest.EthernetFrame(netnstest.Broadcast, b1.MAC, netnstest.EtherTypeIPv6,
			netnstest.UDP6(netip.AddrPortFrom(linkLocal, 4000), netip.MustParseAddrPort("[ff02::1]:9999"), []byte("v6"))))

		assert.False(t, hostHears(a1.IP), "the host got nothing in a1's name")
		assert.Zero(t, a2.Count(tagged("spoofed to a2")))
		offerFor := func(mac net.HardwareAddr) func(netnstest.Frame) bool {
			return func(fr netnstest.Frame) bool {
				if fr.Proto != 17 || fr.DstPort != 68 {
					return false
				}
				m, err := dhcpv4.FromBytes(fr.Payload)
				return err == nil && m.MessageType() == dhcpv4.MessageTypeOffer && m.ClientHWAddr.String() == mac.String()
			}
		}
		_, ok = b1.WaitFor(quiet, offerFor(a1.MAC))
		assert.False(t, ok, "no DHCP answer to a request in a1's name")

		neighbours, err := netlink.NeighList(br.Attrs().Index, netlink.FAMILY_V4)
		require.NoError(t, err)
		for _, nb := range neighbours {
			if nb.IP.Equal(a1.IP.AsSlice()) && nb.HardwareAddr != nil {
				assert.Equal(t, a1.MAC.String(), nb.HardwareAddr.String(), "the host still has a1's address at a1")
			}
		}
		fdb, err := netlink.NeighList(0, unix.AF_BRIDGE)
		require.NoError(t, err)
		b1Link, err := netlink.LinkByName(b1.Name)
		require.NoError(t, err)
		for _, e := range fdb {
			if e.HardwareAddr.String() == a1.MAC.String() {
				assert.NotEqual(t, b1Link.Attrs().Index, e.LinkIndex, "the bridge did not learn a1's MAC on b1's port")
			}
		}
		after, err = n.FilterDrops()
		require.NoError(t, err)
		assert.Equal(t, uint64(8), after.Spoofed[b1.Name]-before.Spoofed[b1.Name], "each of b1's forgeries was counted")

		// No IPv6, even between guests of one owner.
		a1.Send(t, netnstest.EthernetFrame(a2.MAC, a1.MAC, netnstest.EtherTypeIPv6,
			netnstest.UDP6(netip.AddrPortFrom(linkLocal, 4000), netip.MustParseAddrPort("[fe80::2]:9999"), []byte("v6 to a2"))))
		_, ok = a2.WaitFor(quiet, tagged("v6 to a2"))
		assert.False(t, ok)
		after, err = n.FilterDrops()
		require.NoError(t, err)
		assert.Equal(t, uint64(1), after.Spoofed[a1.Name]-before.Spoofed[a1.Name], "a1's IPv6 was counted")

		// a1's own traffic and its address still work: the host reaches a1,
		// and b1 hears none of it.
		_, err = host.WriteToUDPAddrPort([]byte("for a1 after"), netip.AddrPortFrom(a1.IP, 4000))
		require.NoError(t, err)
		_, ok = a1.WaitFor(2*time.Second, tagged("for a1 after"))
		assert.True(t, ok, "the host still reaches a1")
		assert.Zero(t, b1.Count(tagged("for a1 after")))

		// Once the bridge forgets where a1 is, it floods the host's frames
		// for a1 to every port; only a1's own copy goes out.
		a1Link, err := netlink.LinkByName(a1.Name)
		require.NoError(t, err)
		require.NoError(t, netlink.NeighDel(&netlink.Neigh{
			LinkIndex: a1Link.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_MASTER, HardwareAddr: a1.MAC,
		}))
		_, err = host.WriteToUDPAddrPort([]byte("flooded for a1"), netip.AddrPortFrom(a1.IP, 4000))
		require.NoError(t, err)
		_, ok = a1.WaitFor(2*time.Second, tagged("flooded for a1"))
		assert.True(t, ok)
		_, ok = b1.WaitFor(quiet, tagged("flooded for a1"))
		assert.False(t, ok, "a flooded frame for a1 reaches no other guest")
		assert.Zero(t, a2.Count(tagged("flooded for a1")), "not even one of the same owner")

		// DHCP in b1's own name is answered.
		discover(b1, b1.MAC)
		_, ok = b1.WaitFor(2*time.Second, offerFor(b1.MAC))
		assert.True(t, ok, "b1 gets its own offer")

		// A tap no VM holds a lease for carries nothing.
		require.NoError(t, n.AddTap(TapName("vm-stray")))
		stray := netnstest.OpenTap(t, TapName("vm-stray"), MAC("vm-stray"), netip.MustParseAddr("10.77.0.200"))
		before, err = n.FilterDrops()
		require.NoError(t, err)
		send(filterGuest{"stray", stray}, stray.MAC, stray.IP, gwMAC, gw, "stray")
		assert.False(t, hostHears(stray.IP))
		after, err = n.FilterDrops()
		require.NoError(t, err)
		assert.Equal(t, uint64(1), after.UnknownPort-before.UnknownPort)

		// The filter follows the lease table: a new owner joins b1 to
		// alice's guests; after a restart it is rebuilt from the file alone.
		require.NoError(t, n.SetOwner("vm-b1", "alice"))
		send(b1, b1.MAC, b1.IP, a1.MAC, a1.IP, "b1 to a1 as alice")
		_, ok = a1.WaitFor(2*time.Second, tagged("b1 to a1 as alice"))
		assert.True(t, ok, "b1 now shares alice's link")

		require.NoError(t, removeFilter()) // as after a reboot
		require.NoError(t, n.Close())
		n, err = Setup(ctx, Config{LeaseFile: leaseFile, Log: hosttest.Logger(t), Teardown: true})
		require.NoError(t, err)
		send(a2, a2.MAC, a2.IP, b1.MAC, b1.IP, "a2 to b1 after restart")
		_, ok = b1.WaitFor(2*time.Second, tagged("a2 to b1 after restart"))
		assert.True(t, ok, "owners came back from the lease file")
		send(x, x.MAC, x.IP, a1.MAC, a1.IP, "x to a1 after restart")
		_, ok = a1.WaitFor(quiet, tagged("x to a1 after restart"))
		assert.False(t, ok)
		send(b1, b1.MAC, a2.IP, gwMAC, gw, "spoofed after restart")
		assert.False(t, hostHears(a2.IP))

		// Released: b1's tap is no VM's any more.
		require.NoError(t, n.Release("vm-b1"))
		send(b1, b1.MAC, b1.IP, gwMAC, gw, "after release")
		assert.False(t, hostHears(b1.IP))
		drops, err := n.FilterDrops()
		require.NoError(t, err)
		assert.NotContains(t, drops.Spoofed, b1.Name)
		assert.Equal(t, uint64(1), drops.UnknownPort)

		require.NoError(t, n.Close())
		assertNoFilter(t)
	})
}

func assertNoFilter(t *testing.T) {
	t.Helper()
	c, err := nftables.New()
	require.NoError(t, err)
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyBridge)
	require.NoError(t, err)
	for _, tb := range tables {
		assert.NotEqual(t, filterTable, tb.Name, "teardown removes the guest filter")
	}
}
