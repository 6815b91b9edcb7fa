package netsetup

import (
	"context"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/nclient4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/a73x/eitri/agent/netnstest"
)

func linkUp(t *testing.T, name string) {
	t.Helper()
	l, err := netlink.LinkByName(name)
	require.NoError(t, err)
	require.NoError(t, netlink.LinkSetUp(l))
}

// guestPort adds a veth pair standing in for a guest NIC: the host end,
// port, is enslaved to the bridge (the guest filter lets it carry traffic
// only if it is named TapName of a VM with a lease), the guest end "g-"+name
// carries mac.
func guestPort(t *testing.T, bridge, port, name string, mac net.HardwareAddr) {
	t.Helper()
	br, err := netlink.LinkByName(bridge)
	require.NoError(t, err)
	veth := &netlink.Veth{
		LinkAttrs: netlink.LinkAttrs{Name: port, MasterIndex: br.Attrs().Index},
		PeerName:  "g-" + name, PeerHardwareAddr: mac,
	}
	require.NoError(t, netlink.LinkAdd(veth))
	linkUp(t, port)
	linkUp(t, "g-"+name)
}

func dhcpClient(t *testing.T, iface string, timeout time.Duration) *nclient4.Client {
	t.Helper()
	c, err := nclient4.New(iface, nclient4.WithTimeout(timeout), nclient4.WithRetry(2))
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

func TestNetworkInNamespace(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		ctx := context.Background()
		linkUp(t, "lo")
		leaseFile := filepath.Join(t.TempDir(), "state", "leases.json")
		cfg := Config{LeaseFile: leaseFile, Log: hosttest.Logger(t)}

		n, err := Setup(ctx, cfg)
		require.NoError(t, err)
		gw := netip.MustParseAddr("10.77.0.1")
		assert.Equal(t, gw, n.Gateway())

		// Bridge: exists, up, carries the gateway address.
		br, err := netlink.LinkByName(DefaultBridge)
		require.NoError(t, err)
		assert.Equal(t, "bridge", br.Type())
		assert.NotZero(t, br.Attrs().Flags&net.FlagUp)
		addrs, err := netlink.AddrList(br, netlink.FAMILY_V4)
		require.NoError(t, err)
		require.Len(t, addrs, 1)
		assert.Equal(t, "10.77.0.1/24", addrs[0].IPNet.String())

		fwd, err := os.ReadFile("/proc/sys/net/ipv4/ip_forward")
		require.NoError(t, err)
		assert.Equal(t, "1", strings.TrimSpace(string(fwd)))
		assertNAT(t, true)

		// Taps: created persistent, single queue, enslaved, up; idempotent.
		require.NoError(t, n.AddTap("tap-a"))
		require.NoError(t, n.AddTap("tap-a"))
		tap, err := netlink.LinkByName("tap-a")
		require.NoError(t, err)
		tt, ok := tap.(*netlink.Tuntap)
		require.True(t, ok, "tap-a is a %s", tap.Type())
		assert.Equal(t, netlink.TUNTAP_MODE_TAP, tt.Mode)
		assert.False(t, tt.NonPersist)
		assert.Zero(t, tt.Flags&netlink.TUNTAP_MULTI_QUEUE)
		assert.Equal(t, br.Attrs().Index, tt.MasterIndex)
		assert.NotZero(t, tt.Flags&netlink.TUNTAP_NO_PI)
		require.NoError(t, n.RemoveTap("tap-a"))
		_, err = netlink.LinkByName("tap-a")
		assert.Error(t, err)
		require.NoError(t, n.RemoveTap("tap-a"), "removing a missing tap is fine")
		assert.Error(t, n.RemoveTap(DefaultBridge), "must refuse to delete a non-tap")

		// DHCP: the allocated MAC gets its address.
		mac1 := MAC("vm-1")
		addr1, err := n.Allocate("vm-1", mac1, "alice")
		require.NoError(t, err)
		assert.Equal(t, netip.MustParseAddr("10.77.0.2"), addr1)
		_, leased := n.Leased("vm-1")
		assert.False(t, leased, "no guest has asked yet")

		guestPort(t, DefaultBridge, TapName("vm-1"), "vm1", mac1)
		lease, err := dhcpClient(t, "g-vm1", 2*time.Second).Request(ctx)
		require.NoError(t, err)
		ack := lease.ACK
		assert.Equal(t, addr1.AsSlice(), []byte(ack.YourIPAddr.To4()))
		assert.Equal(t, []net.IP{gw.AsSlice()}, ack.Router())
		assert.Equal(t, net.IP(gw.AsSlice()), ack.ServerIdentifier().To4())
		assert.Equal(t, net.CIDRMask(24, 32), ack.SubnetMask())
		assert.Equal(t, time.Hour, ack.IPAddressLeaseTime(0))
		assert.Equal(t, []net.IP{gw.AsSlice()}, ack.DNS(), "the forwarder on the gateway is the guests' resolver")
		// The server records the ACK just after sending it.
		require.Eventually(t, func() bool { _, leased := n.Leased("vm-1"); return leased }, 2*time.Second, 5*time.Millisecond)
		a, _ := n.Leased("vm-1")
		assert.Equal(t, addr1, a)

		// An unknown MAC gets no offer.
		guestPort(t, DefaultBridge, "h-stray", "stray", net.HardwareAddr{0x02, 0, 0, 0, 0, 0x99})
		_, err = dhcpClient(t, "g-stray", 700*time.Millisecond).DiscoverOffer(ctx)
		assert.Error(t, err)

		// A request for an address that is not the VM's is refused.
		_, err = dhcpClient(t, "g-vm1", 2*time.Second).Request(ctx, dhcpv4.WithOption(dhcpv4.OptRequestedIPAddress(net.IPv4(10, 77, 0, 50))))
		assert.Error(t, err)

		addr2, err := n.Allocate("vm-2", MAC("vm-2"), "alice")
		require.NoError(t, err)
		assert.Equal(t, netip.MustParseAddr("10.77.0.3"), addr2)
		_, err = n.Allocate("vm-x", mac1, "alice")
		assert.ErrorContains(t, err, "already belongs to vm vm-1")
		require.NoError(t, n.Close())

		// The bridge and NAT outlive Close; the leases outlive the process.
		_, err = netlink.LinkByName(DefaultBridge)
		require.NoError(t, err)
		assertNAT(t, true)

		n, err = Setup(ctx, Config{LeaseFile: leaseFile, Log: hosttest.Logger(t), Teardown: true})
		require.NoError(t, err)
		again, err := n.Allocate("vm-1", mac1, "alice")
		require.NoError(t, err)
		assert.Equal(t, addr1, again)
		_, leased = n.Leased("vm-1")
		assert.True(t, leased, "the ACK was recorded in the lease file")
		a, leased = n.Leased("vm-2")
		assert.Equal(t, addr2, a)
		assert.False(t, leased)
		_, leased = n.Leased("vm-unknown")
		assert.False(t, leased)

		// The restarted server renews the guest's lease.
		lease, err = dhcpClient(t, "g-vm1", 2*time.Second).Request(ctx)
		require.NoError(t, err)
		assert.Equal(t, addr1.AsSlice(), []byte(lease.ACK.YourIPAddr.To4()))

		// A released address goes to the next VM.
		require.NoError(t, n.Release("vm-2"))
		require.NoError(t, n.Release("vm-2"))
		addr3, err := n.Allocate("vm-3", MAC("vm-3"), "bob")
		require.NoError(t, err)
		assert.Equal(t, addr2, addr3)

		require.NoError(t, n.Close())
		_, err = netlink.LinkByName(DefaultBridge)
		assert.Error(t, err, "teardown removes the bridge")
		assertNAT(t, false)
	})
}

// assertNAT checks the eitri table: one masquerade rule in a postrouting
// NAT chain.
func assertNAT(t *testing.T, present bool) {
	t.Helper()
	c, err := nftables.New()
	require.NoError(t, err)
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyIPv4)
	require.NoError(t, err)
	var table *nftables.Table
	for _, tb := range tables {
		if tb.Name == nftTable {
			table = tb
		}
	}
	if !present {
		assert.Nil(t, table, "nat table left behind")
		return
	}
	require.NotNil(t, table, "nat table missing")
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyIPv4)
	require.NoError(t, err)
	var chain *nftables.Chain
	for _, ch := range chains {
		if ch.Table.Name == nftTable && ch.Name == "postrouting" {
			chain = ch
		}
	}
	require.NotNil(t, chain)
	assert.Equal(t, nftables.ChainTypeNAT, chain.Type)
	rules, err := c.GetRules(table, chain)
	require.NoError(t, err)
	require.Len(t, rules, 1, "re-running Setup must not duplicate the rule")
	var masq bool
	for _, e := range rules[0].Exprs {
		if _, ok := e.(*expr.Masq); ok {
			masq = true
		}
	}
	assert.True(t, masq)
}

func TestSetupRejectsBadConfig(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	corrupt := filepath.Join(dir, "corrupt.json")
	require.NoError(t, os.WriteFile(corrupt, []byte("{not json"), 0o600))

	tests := []struct {
		name string
		cfg  Config
		want string
	}{
		{"no lease file", Config{}, "LeaseFile is required"},
		{"ipv6 prefix", Config{LeaseFile: filepath.Join(dir, "l.json"), Prefix: netip.MustParsePrefix("fd00::1/64")}, "not IPv4"},
		{"tiny prefix", Config{LeaseFile: filepath.Join(dir, "l.json"), Prefix: netip.MustParsePrefix("10.0.0.1/31")}, "/8 to /29"},
		{"long bridge name", Config{LeaseFile: filepath.Join(dir, "l.json"), Bridge: "a-very-long-bridge"}, "longer than 15"},
		// An unreadable lease table must stop Setup, not be read as empty.
		{"corrupt lease file", Config{LeaseFile: corrupt}, "corrupt"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Setup(ctx, tc.cfg)
			assert.ErrorContains(t, err, tc.want)
		})
	}
}

func TestPool(t *testing.T) {
	tests := []struct {
		prefix      string
		gateway     string
		first, last string
	}{
		{"10.77.0.1/24", "10.77.0.1", "10.77.0.2", "10.77.0.254"},
		{"10.77.0.0/24", "10.77.0.1", "10.77.0.2", "10.77.0.254"},
		{"192.168.5.9/29", "192.168.5.9", "192.168.5.10", "192.168.5.14"},
		{"172.16.0.1/16", "172.16.0.1", "172.16.0.2", "172.16.255.254"},
	}
	for _, tc := range tests {
		t.Run(tc.prefix, func(t *testing.T) {
			p, err := newPool(netip.MustParsePrefix(tc.prefix))
			require.NoError(t, err)
			if tc.prefix == "192.168.5.9/29" {
				// the gateway is the first host address of the network
				assert.Equal(t, "192.168.5.9", p.gateway.String())
			}
			assert.Equal(t, tc.gateway, p.gateway.String())
			assert.False(t, p.contains(p.gateway))
			assert.True(t, p.contains(netip.MustParseAddr(tc.first)))
			assert.True(t, p.contains(netip.MustParseAddr(tc.last)))
			assert.False(t, p.contains(netip.MustParseAddr(tc.last).Next()), "broadcast is not a guest address")
		})
	}
}

func TestLeaseFileRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "leases.json")
	leases, err := loadLeases(path)
	require.NoError(t, err)
	assert.Empty(t, leases, "a missing file is an empty table")

	acked := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	in := []*lease{
		{VMID: "a", MAC: "02:00:00:00:00:01", Addr: netip.MustParseAddr("10.77.0.2"), AckedAt: &acked},
		{VMID: "b", MAC: "02:00:00:00:00:02", Addr: netip.MustParseAddr("10.77.0.3")},
	}
	require.NoError(t, saveLeases(path, in))
	out, err := loadLeases(path)
	require.NoError(t, err)
	assert.Equal(t, in, out)

	entries, err := os.ReadDir(filepath.Dir(path))
	require.NoError(t, err)
	assert.Len(t, entries, 1, "no temp files left behind")

	require.NoError(t, os.WriteFile(path, []byte(`{"version": 7, "leases": []}`), 0o600))
	_, err = loadLeases(path)
	assert.ErrorContains(t, err, "version 7")
}

func TestNames(t *testing.T) {
	for _, id := range []string{"vm-1", "0b6f3d1e-9c1a-4c55-9d43-93b1f1f3a2aa"} {
		mac := MAC(id)
		assert.Len(t, mac, 6)
		assert.Equal(t, byte(0x02), mac[0]&0x03, "locally administered unicast")
		assert.Equal(t, mac, MAC(id), "stable")
		name := TapName(id)
		assert.LessOrEqual(t, len(name), 15)
		assert.Equal(t, name, TapName(id))
	}
	assert.NotEqual(t, MAC("vm-1"), MAC("vm-2"))
	assert.NotEqual(t, TapName("vm-1"), TapName("vm-2"))
}

// inNetns runs body in its own network namespace.
func inNetns(t *testing.T, body func(t *testing.T)) {
	netnstest.Run(t, 80*time.Second, "creates a network namespace with a bridge, taps and nftables rules", body)
}
