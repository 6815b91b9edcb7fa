package netsetup

import (
	"fmt"
	"net/netip"
	"os"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
)

// nftTable is the nftables table eitri owns. Everything eitri adds lives in
// it, so replacing or removing it never touches anyone else's rules.
const nftTable = "eitri"

// ensureNAT (re)writes the eitri table in one atomic transaction: a NAT
// postrouting chain that masquerades traffic from the guest prefix leaving
// through any interface other than the bridge. Guest-to-guest and
// host-to-guest traffic stays un-NATed.
func ensureNAT(prefix netip.Prefix, bridge string) error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("netsetup: nftables: %w", err)
	}
	if err := deleteTable(c, nftables.TableFamilyIPv4, nftTable); err != nil {
		return err
	}
	t := c.AddTable(&nftables.Table{Family: nftables.TableFamilyIPv4, Name: nftTable})
	ch := c.AddChain(&nftables.Chain{
		Name:     "postrouting",
		Table:    t,
		Type:     nftables.ChainTypeNAT,
		Hooknum:  nftables.ChainHookPostrouting,
		Priority: nftables.ChainPriorityNATSource,
	})
	network := prefix.Masked().Addr().As4()
	mask := netipMask(prefix.Bits())
	c.AddRule(&nftables.Rule{
		Table: t,
		Chain: ch,
		Exprs: []expr.Any{
			// ip saddr & mask == network
			&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 12, Len: 4},
			&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: mask, Xor: []byte{0, 0, 0, 0}},
			&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: network[:]},
			// oifname != bridge
			&expr.Meta{Key: expr.MetaKeyOIFNAME, Register: 1},
			&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: ifname(bridge)},
			&expr.Masq{},
		},
	})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("netsetup: install nat rules: %w", err)
	}
	return nil
}

// removeNAT deletes the eitri table if it exists.
func removeNAT() error {
	c, err := nftables.New()
	if err != nil {
		return fmt.Errorf("netsetup: nftables: %w", err)
	}
	if err := deleteTable(c, nftables.TableFamilyIPv4, nftTable); err != nil {
		return err
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("netsetup: remove nat rules: %w", err)
	}
	return nil
}

// deleteTable queues deletion of one of eitri's tables if it exists;
// deleting a table that is not there would fail the whole batch.
func deleteTable(c *nftables.Conn, family nftables.TableFamily, name string) error {
	tables, err := c.ListTablesOfFamily(family)
	if err != nil {
		return fmt.Errorf("netsetup: list nftables tables: %w", err)
	}
	for _, t := range tables {
		if t.Name == name {
			c.DelTable(t)
		}
	}
	return nil
}

func netipMask(bits int) []byte {
	m := uint32(0xffffffff) << (32 - bits)
	return []byte{byte(m >> 24), byte(m >> 16), byte(m >> 8), byte(m)}
}

// ifname pads an interface name the way the kernel stores it (IFNAMSIZ).
func ifname(name string) []byte {
	b := make([]byte, 16)
	copy(b, name)
	return b
}

// enableForwarding turns on IPv4 forwarding so guest traffic can be routed
// out of the host.
func enableForwarding() error {
	const path = "/proc/sys/net/ipv4/ip_forward"
	cur, err := os.ReadFile(path)
	if err == nil && len(cur) > 0 && cur[0] == '1' {
		return nil
	}
	if err := os.WriteFile(path, []byte("1\n"), 0o644); err != nil {
		return fmt.Errorf("netsetup: enable ip forwarding: %w", err)
	}
	return nil
}
