package hostvm

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/exposeproxy"
	"github.com/a73x/eitri/agent/netnstest"
	"github.com/a73x/eitri/agent/netsetup"
)

// TestGuestsOfOtherOwnersCannotTakeOrReachEachOther replays the theft one
// tenant's guest could try on another's: a guest takes another tenant's
// address (its IP, its MAC, gratuitous ARP) to receive what is sent to the
// victim's published port.
//
// alice's and bob's guests are real QEMU guests created through the engine
// with their owners. The attacker is bob's too, but a stand-in: the test
// holds its tap and writes the frames a hostile guest would (the test guest
// sends nothing of its own accord). Its tap, lease and filter are made by
// the same code that makes a real guest's.
func TestGuestsOfOtherOwnersCannotTakeOrReachEachOther(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		ctx := context.Background()
		dir, url, sha := netnsEnv(t)
		const aliceID, bobID, attackerID = "vm-iso-alice", "vm-iso-bob", "vm-iso-bob-evil"
		killLeftovers(t, dir, aliceID, bobID)
		h := startHost(t, dir, netip.MustParsePrefix("10.78.5.1/24"), true)
		t.Cleanup(func() { h.stop(t) })

		alice := desiredVM(aliceID, "alice-web", url, sha, "running")
		alice.Owner = "user-alice"
		bob := desiredVM(bobID, "bob-db", url, sha, "running")
		bob.Owner = "user-bob"
		require.True(t, h.eng.Apply(snapshot(1, alice, bob)))
		aliceIP := netip.MustParseAddr(waitRow(t, h, aliceID, readyWithin, "ready", isReady).GetIp())
		bobIP := netip.MustParseAddr(waitRow(t, h, bobID, readyWithin, "ready", isReady).GetIp())
		aliceMAC, bobMAC := netsetup.MAC(aliceID), netsetup.MAC(bobID)

		require.NoError(t, h.hyper.plug(attackerID, "user-bob"))
		evilIP, _ := h.net.Leased(attackerID)
		evil := netnstest.OpenTap(t, netsetup.TapName(attackerID), netsetup.MAC(attackerID), evilIP)

		// alice's web server, published the way the agent publishes it.
		proxy := exposeproxy.New(exposeproxy.Config{Log: hosttest.Logger(t), Resolve: func(id string) (netip.Addr, bool) {
			return h.hyper.Address(ctx, id)
		}})
		t.Cleanup(proxy.Close)
		st := proxy.Converge([]exposeproxy.Spec{{
			ID: "alice-web", VMID: aliceID, Protocol: exposeproxy.TCP,
			Listen: netip.MustParseAddrPort("127.0.0.1:0"), GuestPort: 80,
		}})
		require.Len(t, st, 1)
		require.Equal(t, exposeproxy.StateActive, st[0].State, st[0].Reason)
		published := "http://" + st[0].Bound.String() + "/"
		assert.Contains(t, getHostname(t, aliceIP.String()), "hostname=alice-web")
		assert.Equal(t, 10, servedBy(t, published, "alice-web", 10), "the published port reaches alice")

		// echo asks a guest's UDP echo port, from the attacker's own
		// address, until it answers or the time is up.
		echo := func(ip netip.Addr, mac net.HardwareAddr, tag string, within time.Duration) (sent int, answered bool) {
			answer := func(fr netnstest.Frame) bool {
				return fr.Proto == 17 && fr.IPSrc == ip && fr.SrcPort == 7 && string(fr.Payload) == tag
			}
			deadline := time.Now().Add(within)
			for time.Now().Before(deadline) {
				evil.Send(t, netnstest.EthernetFrame(mac, evil.MAC, netnstest.EtherTypeIPv4,
					netnstest.UDP4(netip.AddrPortFrom(evil.IP, 5000), netip.AddrPortFrom(ip, 7), []byte(tag))))
				sent++
				if _, ok := evil.WaitFor(500*time.Millisecond, answer); ok {
					return sent, true
				}
			}
			return sent, false
		}

		// Guests of one owner reach each other: an app and its database.
		_, ok := echo(bobIP, bobMAC, "bob to bob", 15*time.Second)
		assert.True(t, ok, "bob's guests reach each other")

		// Guests of different owners never do.
		before, err := h.net.FilterDrops()
		require.NoError(t, err)
		sent, ok := echo(aliceIP, aliceMAC, "bob to alice", 3*time.Second)
		assert.False(t, ok, "bob's guest does not reach alice's")
		after, err := h.net.FilterDrops()
		require.NoError(t, err)
		assert.GreaterOrEqual(t, after.CrossOwner-before.CrossOwner, uint64(sent), "each datagram was dropped between owners")

		// The attack: alice's address and MAC, announced again and again
		// while alice's users use her published port.
		before = after
		forgeries := 0
		forge := func() {
			frames := [][]byte{
				// "alice's IP is at the attacker", to everyone and to the gateway
				netnstest.EthernetFrame(netnstest.Broadcast, evil.MAC, netnstest.EtherTypeARP,
					netnstest.ARP(2, evil.MAC, aliceIP, netnstest.Broadcast, aliceIP)),
				netnstest.EthernetFrame(netnstest.Broadcast, evil.MAC, netnstest.EtherTypeARP,
					netnstest.ARP(1, evil.MAC, aliceIP, nil, h.net.Gateway())),
				// alice's MAC as source, so the bridge would learn it here
				netnstest.EthernetFrame(netnstest.Broadcast, aliceMAC, netnstest.EtherTypeARP,
					netnstest.ARP(2, aliceMAC, aliceIP, netnstest.Broadcast, aliceIP)),
				// traffic in alice's name
				netnstest.EthernetFrame(aliceMAC, aliceMAC, netnstest.EtherTypeIPv4,
					netnstest.UDP4(netip.AddrPortFrom(aliceIP, 80), netip.AddrPortFrom(h.net.Gateway(), 9), []byte("as alice"))),
			}
			for _, f := range frames {
				evil.Send(t, f)
				forgeries++
			}
		}
		served := 0
		for range 10 {
			forge()
			time.Sleep(200 * time.Millisecond)
			served += servedBy(t, published, "alice-web", 1)
		}
		assert.Equal(t, 10, served, "every request to alice's published port reached alice")
		stolen := evil.Count(func(fr netnstest.Frame) bool { return fr.Type == netnstest.EtherTypeIPv4 && fr.IPDst == aliceIP })
		assert.Zero(t, stolen, "nothing for alice's address reached the attacker")
		after, err = h.net.FilterDrops()
		require.NoError(t, err)
		assert.Equal(t, forgeries, int(after.Spoofed[evil.Name]-before.Spoofed[evil.Name]), "every forged frame was dropped")

		// alice's guest is unharmed, and so is bob's link to bob.
		assert.Contains(t, getHostname(t, aliceIP.String()), "hostname=alice-web")
		_, ok = echo(bobIP, bobMAC, "bob to bob, after", 10*time.Second)
		assert.True(t, ok)
	})
}

// servedBy makes n requests to url, each on a fresh connection (a fresh
// dial from the proxy to the guest), and counts the answers from the guest
// named name.
func servedBy(t *testing.T, url, name string, n int) int {
	t.Helper()
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	got := 0
	for i := range n {
		resp, err := client.Get(url)
		if err != nil {
			t.Logf("request %d: %v", i, err)
			continue
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil && resp.StatusCode == http.StatusOK && strings.Contains(string(body), "hostname="+name+" ") {
			got++
		} else {
			t.Logf("request %d: %s %q %v", i, resp.Status, body, err)
		}
	}
	return got
}
