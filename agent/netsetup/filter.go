package netsetup

import (
	"cmp"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
)

// The guest filter keeps guests on the shared bridge from posing as each
// other and apart by owner. It is a bridge-family nftables table of eitri's
// own, rewritten whole in one atomic transaction from the lease table (a
// function of it, so a restarted agent rebuilds it before it knows anything
// else, and it never touches anyone else's rules):
//
//   - prerouting (every frame a port sends, before the bridge learns its
//     source MAC or delivers it to the host): a frame from a VM's tap
//     (TapName of its VM id) must come from the VM's MAC; IPv4 only from its
//     leased address, or DHCP (0.0.0.0:68 → 255.255.255.255:67); ARP only
//     with that MAC and address (or 0.0.0.0, a probe) as sender; a DHCP
//     request must name the VM's own MAC as client. Everything else from a
//     guest is dropped, IPv6 included (see guestChain). Frames from a tap
//     no VM holds a lease for are dropped.
//   - forward (port to port; frames to and from the host never pass it):
//     only between guests of the same non-empty owner.
//   - input (frames the bridge hands to the host): no IPv4 for another
//     guest's address. The host forwards IPv4, so a guest could otherwise
//     send another's address to the gateway's MAC and be routed around the
//     owner check. Guests of one owner share the link and need no router.
//     (This cannot live in the IPv4 family's forward hook: with
//     br_netfilter, bridged frames pass that hook too, looking the same.)
//   - output (frames the host sends out of a port): unicast only to the
//     guest it is for. The bridge floods unicast for a MAC it has not learnt
//     or has forgotten (a quiet guest, after 5 minutes), and a flooded copy
//     would show one tenant's traffic to the others.
//
// Frames the host sends (DHCP replies, the published ports' proxy, NAT
// replies) are held to nothing but the output rule, and guest frames to the
// host pass once they are genuine: every guest reaches the gateway, the NAT
// and its own published ports.
const filterTable = "eitri-bridge"

// Rule comments, shown by `nft list ruleset` and used to read counters back.
const (
	commentSpoofed    = "eitri: not from this guest's own MAC and address"
	commentUnknown    = "eitri: tap of no VM with a lease"
	commentCrossOwner = "eitri: guests of different owners"
	commentRouted     = "eitri: guest to guest through the host"
)

// bridgeFilterPriority is the bridge family's "filter" priority.
const bridgeFilterPriority = -200

// filterPort is what the filter knows about one VM's tap.
type filterPort struct {
	Tap   string
	MAC   net.HardwareAddr
	Addr  netip.Addr
	Owner string
}

// portsLocked lists a port per lease, ordered by tap. n.mu held.
func (n *Network) portsLocked() []filterPort {
	ports := make([]filterPort, 0, len(n.leases))
	for _, l := range n.leases {
		mac, err := net.ParseMAC(l.MAC)
		if err != nil {
			continue // load refuses these; a port without a MAC could send nothing anyway
		}
		ports = append(ports, filterPort{Tap: TapName(l.VMID), MAC: mac, Addr: l.Addr, Owner: l.Owner})
	}
	slices.SortFunc(ports, func(a, b filterPort) int { return cmp.Compare(a.Tap, b.Tap) })
	return ports
}

// peerGroups returns the taps of each owner with more than one guest here,
// each group and the list in a stable order. An empty owner is no group:
// those guests (from a control plane that does not send owners) reach no
// other guest.
func peerGroups(ports []filterPort) [][]string {
	byOwner := map[string][]string{}
	for _, p := range ports {
		if p.Owner != "" {
			byOwner[p.Owner] = append(byOwner[p.Owner], p.Tap)
		}
	}
	var groups [][]string
	for _, taps := range byOwner {
		if len(taps) > 1 {
			slices.Sort(taps)
			groups = append(groups, taps)
		}
	}
	slices.SortFunc(groups, func(a, b []string) int { return cmp.Compare(a[0], b[0]) })
	return groups
}

func (n *Network) syncFilter() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.syncFilterLocked()
}

// syncFilterLocked rewrites the filter from the lease table. n.mu held, so
// two writes never race and the last one is always the newest table.
func (n *Network) syncFilterLocked() error {
	ports := n.portsLocked()
	if err := writeFilter(n.pool, ports); err != nil {
		return err
	}
	n.log.Debug("guest filter written", "ports", len(ports), "peer_groups", len(peerGroups(ports)))
	return nil
}

// writeFilter replaces the filter table with one for ports, atomically.
func writeFilter(pool pool, ports []filterPort) error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("netsetup: nftables: %w", err)
	}
	if err := deleteTable(c, nftables.TableFamilyBridge, filterTable); err != nil {
		return err
	}
	t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyBridge, Name: filterTable})
	base := func(name string, hook *nftables.ChainHook) *nftables.Chain {
		return c.AddChain(&nftables.Chain{
			Name: name, Table: t, Type: nftables.ChainTypeFilter, Hooknum: hook,
			Priority: nftables.ChainPriorityRef(bridgeFilterPriority),
		})
	}
	// Ports are told apart by name alone: `meta ibrname` needs
	// CONFIG_NFT_BRIDGE_META, which not every kernel has. Only eitri names
	// interfaces with tapPrefix, and frames of other interfaces (other
	// bridges' ports) fall through to the chains' accept policy.
	ours := []byte(tapPrefix) // no NUL: a prefix match, like "eitri*"

	pre := base("prerouting", nftables.ChainHookPrerouting)
	for _, p := range ports {
		ch := c.AddChain(&nftables.Chain{Name: "from-" + p.Tap, Table: t})
		for _, r := range guestChain(p) {
			c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: r.exprs, UserData: r.comment})
		}
		c.AddRule(&nftables.Rule{Table: t, Chain: pre, Exprs: join(
			metaIs(expr.MetaKeyIIFNAME, expr.CmpOpEq, ifname(p.Tap)),
			[]expr.Any{&expr.Verdict{Kind: expr.VerdictJump, Chain: ch.Name}},
		)})
	}
	c.AddRule(&nftables.Rule{Table: t, Chain: pre, Exprs: join(
		metaIs(expr.MetaKeyIIFNAME, expr.CmpOpEq, ours),
		counted(expr.VerdictDrop),
	), UserData: comment(commentUnknown)})

	fwd := base("forward", nftables.ChainHookForward)
	for i, taps := range peerGroups(ports) {
		set := &nftables.Set{Table: t, Name: fmt.Sprintf("owner-%d", i+1), KeyType: nftables.TypeIFName}
		elems := make([]nftables.SetElement, len(taps))
		for j, tap := range taps {
			elems[j] = nftables.SetElement{Key: ifname(tap)}
		}
		if err := c.AddSet(set, elems); err != nil {
			return fmt.Errorf("netsetup: guest filter set: %w", err)
		}
		c.AddRule(&nftables.Rule{Table: t, Chain: fwd, Exprs: join(
			inSet(expr.MetaKeyIIFNAME, set),
			inSet(expr.MetaKeyOIFNAME, set),
			verdict(expr.VerdictAccept),
		)})
	}
	for _, key := range []expr.MetaKey{expr.MetaKeyIIFNAME, expr.MetaKeyOIFNAME} {
		c.AddRule(&nftables.Rule{Table: t, Chain: fwd, Exprs: join(
			metaIs(key, expr.CmpOpEq, ours),
			counted(expr.VerdictDrop),
		), UserData: comment(commentCrossOwner)})
	}

	in := base("input", nftables.ChainHookInput)
	network, gateway, bcast := pool.prefix.Addr().As4(), pool.gateway.As4(), pool.last.Next().As4()
	c.AddRule(&nftables.Rule{Table: t, Chain: in, Exprs: join(
		metaIs(expr.MetaKeyIIFNAME, expr.CmpOpEq, ours),
		etherType(0x0800),
		[]expr.Any{
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: netipMask(pool.prefix.Bits()), Xor: []byte{0, 0, 0, 0}},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: network[:]},
		},
		payloadIs(expr.PayloadBaseNetworkHeader, 16, expr.CmpOpNeq, gateway[:]),
		payloadIs(expr.PayloadBaseNetworkHeader, 16, expr.CmpOpNeq, bcast[:]),
		counted(expr.VerdictDrop),
	), UserData: comment(commentRouted)})

	out := base("output", nftables.ChainHookOutput)
	for _, p := range ports {
		c.AddRule(&nftables.Rule{Table: t, Chain: out, Exprs: join(
			metaIs(expr.MetaKeyOIFNAME, expr.CmpOpEq, ifname(p.Tap)),
			[]expr.Any{ // unicast: the group bit of the first octet is clear
				&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseLLHeader, Offset: 0, Len: 1},
				&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 1, Mask: []byte{0x01}, Xor: []byte{0}},
				&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{0}},
			},
			payloadIs(expr.PayloadBaseLLHeader, 0, expr.CmpOpNeq, p.MAC),
			verdict(expr.VerdictDrop),
		)})
	}

	if err := c.Flush(); err != nil {
		return fmt.Errorf("netsetup: write guest filter: %w", err)
	}
	return nil
}

type rule struct {
	exprs   []expr.Any
	comment []byte
}

// guestChain is the rules one tap's frames run through, in order; the last
// drops whatever no earlier rule accepted.
//
// IPv6 is dropped, link-local included: guests get IPv4 only (DHCPv4, IPv4
// NAT, published ports dial IPv4), so IPv6 carries nothing eitri offers,
// and letting link-local through would mean policing neighbour discovery
// (a guest answering for another's address) to keep the same promise.
func guestChain(p filterPort) []rule {
	mac := []byte(p.MAC)
	ipv4 := etherType(0x0800)
	udp := join(
		[]expr.Any{&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1}},
		[]expr.Any{&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{17}}},
	)
	toDHCPServer := join(udp, payloadIs(expr.PayloadBaseTransportHeader, 2, expr.CmpOpEq, be16(67)))
	// BOOTP chaddr: the UDP header (8) plus 28 bytes into the message. The
	// DHCP server answers by it, so a guest asking in another's name could
	// take or release that guest's lease.
	chaddrNotOwn := payloadIs(expr.PayloadBaseTransportHeader, 8+28, expr.CmpOpNeq, mac)

	rules := []rule{
		{join(payloadIs(expr.PayloadBaseLLHeader, 6, expr.CmpOpNeq, mac), counted(expr.VerdictDrop)), comment(commentSpoofed)},
		{join(ipv4, toDHCPServer, chaddrNotOwn, counted(expr.VerdictDrop)), comment(commentSpoofed)},
		{join(ipv4,
			payloadIs(expr.PayloadBaseNetworkHeader, 12, expr.CmpOpEq, []byte{0, 0, 0, 0}),
			payloadIs(expr.PayloadBaseNetworkHeader, 16, expr.CmpOpEq, []byte{255, 255, 255, 255}),
			udp,
			payloadIs(expr.PayloadBaseTransportHeader, 0, expr.CmpOpEq, be16(68)),
			payloadIs(expr.PayloadBaseTransportHeader, 2, expr.CmpOpEq, be16(67)),
			verdict(expr.VerdictAccept),
		), nil},
	}
	if p.Addr.Is4() {
		own := p.Addr.As4()
		// Ethernet/IPv4 ARP (htype 1, ptype 0x0800, hlen 6, plen 4) whose
		// sender is this guest: the sender pair is what neighbours cache.
		arpFrom := func(spa []byte) rule {
			return rule{join(
				etherType(0x0806),
				payloadIs(expr.PayloadBaseNetworkHeader, 0, expr.CmpOpEq, []byte{0, 1, 8, 0, 6, 4}),
				payloadIs(expr.PayloadBaseNetworkHeader, 8, expr.CmpOpEq, mac),
				payloadIs(expr.PayloadBaseNetworkHeader, 14, expr.CmpOpEq, spa),
				verdict(expr.VerdictAccept),
			), nil}
		}
		rules = append(rules,
			rule{join(ipv4, payloadIs(expr.PayloadBaseNetworkHeader, 12, expr.CmpOpEq, own[:]), verdict(expr.VerdictAccept)), nil},
			arpFrom(own[:]),
			arpFrom([]byte{0, 0, 0, 0}), // an address-conflict probe claims nothing
		)
	}
	return append(rules, rule{counted(expr.VerdictDrop), comment(commentSpoofed)})
}

// Drops counts what the guest filter has dropped since it was last
// written (each write starts the counters again).
type Drops struct {
	// Spoofed is by tap: frames not from the guest's own MAC and address,
	// and kinds of traffic guests may not send.
	Spoofed map[string]uint64
	// CrossOwner is frames between guests of different owners.
	CrossOwner uint64
	// Routed is frames sent to the gateway for another guest's address.
	Routed uint64
	// UnknownPort is frames from taps no VM holds a lease for.
	UnknownPort uint64
}

// FilterDrops reads the guest filter's drop counters.
func (n *Network) FilterDrops() (Drops, error) {
	d := Drops{Spoofed: map[string]uint64{}}
	c, err := nftables.New()
	if err != nil {
		return d, fmt.Errorf("netsetup: nftables: %w", err)
	}
	t := &nftables.Table{Family: nftables.TableFamilyBridge, Name: filterTable}
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyBridge)
	if err != nil {
		return d, fmt.Errorf("netsetup: list guest filter: %w", err)
	}
	for _, ch := range chains {
		if ch.Table.Name != filterTable {
			continue
		}
		rules, err := c.GetRules(t, ch)
		if err != nil {
			return d, fmt.Errorf("netsetup: read guest filter: %w", err)
		}
		for _, r := range rules {
			text, _ := userdata.GetString(r.UserData, userdata.TypeComment)
			var packets uint64
			for _, e := range r.Exprs {
				if ctr, ok := e.(*expr.Counter); ok {
					packets += ctr.Packets
				}
			}
			switch {
			case text == commentSpoofed:
				d.Spoofed[strings.TrimPrefix(ch.Name, "from-")] += packets
			case text == commentCrossOwner:
				d.CrossOwner += packets
			case text == commentRouted:
				d.Routed += packets
			case text == commentUnknown:
				d.UnknownPort += packets
			}
		}
	}
	return d, nil
}

// removeFilter deletes the guest filter table if it exists.
func removeFilter() error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("netsetup: nftables: %w", err)
	}
	if err := deleteTable(c, nftables.TableFamilyBridge, filterTable); err != nil {
		return err
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("netsetup: remove guest filter: %w", err)
	}
	return nil
}

func join(parts ...[]expr.Any) []expr.Any { return slices.Concat(parts...) }

func payloadIs(base expr.PayloadBase, offset uint32, op expr.CmpOp, data []byte) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: base, Offset: offset, Len: uint32(len(data))},
		&expr.Cmp{Op: op, Register: 1, Data: data},
	}
}

func etherType(t uint16) []expr.Any {
	return payloadIs(expr.PayloadBaseLLHeader, 12, expr.CmpOpEq, be16(t))
}

func metaIs(key expr.MetaKey, op expr.CmpOp, data []byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: data},
	}
}

func inSet(key expr.MetaKey, s *nftables.Set) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID},
	}
}

func verdict(k expr.VerdictKind) []expr.Any { return []expr.Any{&expr.Verdict{Kind: k}} }

func counted(k expr.VerdictKind) []expr.Any {
	return []expr.Any{&expr.Counter{}, &expr.Verdict{Kind: k}}
}

func comment(s string) []byte { return userdata.AppendString(nil, userdata.TypeComment, s) }

func be16(v uint16) []byte { return []byte{byte(v >> 8), byte(v)} }
