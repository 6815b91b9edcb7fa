package netsetup

import (
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4"
	"github.com/insomniacslk/dhcp/dhcpv4/server4"
)

// startDHCP listens on port 67 bound to the bridge only, so the server never
// answers on the host's other networks.
func (n *Network) startDHCP() error {
	srv, err := server4.NewServer(n.cfg.Bridge, &net.UDPAddr{IP: net.IPv4zero, Port: dhcpv4.ServerPort}, n.handleDHCP)
	if err != nil {
		return fmt.Errorf("netsetup: dhcp server on %s: %w", n.cfg.Bridge, err)
	}
	n.srv = srv
	n.serveDone = make(chan struct{})
	go func() {
		defer close(n.serveDone)
		_ = srv.Serve() // returns when Close closes the socket
	}()
	return nil
}

// handleDHCP answers only MACs the agent allocated: a guest this host did not
// create, or anything else on the bridge, gets no offer.
func (n *Network) handleDHCP(conn net.PacketConn, peer net.Addr, req *dhcpv4.DHCPv4) {
	if req.OpCode != dhcpv4.OpcodeBootRequest {
		return
	}
	mac := req.ClientHWAddr.String()
	n.mu.Lock()
	l, known := n.byMAC[mac]
	var vmID string
	var addr netip.Addr
	if known {
		vmID, addr = l.VMID, l.Addr
	}
	n.mu.Unlock()
	log := n.log.With("mac", mac, "type", req.MessageType().String())
	if !known {
		log.Debug("dhcp: ignoring unknown MAC")
		return
	}
	log = log.With("vm", vmID, "addr", addr)

	switch req.MessageType() {
	case dhcpv4.MessageTypeDiscover:
		n.reply(conn, peer, req, dhcpv4.MessageTypeOffer, addr, log)
	case dhcpv4.MessageTypeRequest:
		// A client that picked another server's offer names that server.
		if sid := req.ServerIdentifier(); sid != nil && !sid.Equal(n.pool.gateway.AsSlice()) {
			return
		}
		asked := req.RequestedIPAddress()
		if asked == nil || asked.IsUnspecified() {
			asked = req.ClientIPAddr // renewing or rebinding
		}
		if want, ok := netip.AddrFromSlice(asked.To4()); !ok || want != addr {
			log.Info("dhcp: refusing request for another address", "requested", asked)
			// A NAK always goes to broadcast: the client has no usable address.
			n.reply(conn, &net.UDPAddr{IP: net.IPv4bcast, Port: dhcpv4.ClientPort}, req, dhcpv4.MessageTypeNak, netip.Addr{}, log)
			return
		}
		if n.reply(conn, peer, req, dhcpv4.MessageTypeAck, addr, log) {
			n.markAcked(vmID, mac)
		}
	case dhcpv4.MessageTypeDecline:
		log.Warn("dhcp: guest declined its address (in use by something else on the bridge?)")
	case dhcpv4.MessageTypeRelease:
		log.Debug("dhcp: guest released its address; it stays reserved for the vm")
	}
}

// reply sends one answer; it reports whether the send succeeded.
func (n *Network) reply(conn net.PacketConn, peer net.Addr, req *dhcpv4.DHCPv4, mt dhcpv4.MessageType, addr netip.Addr, log interface {
	Warn(string, ...any)
	Debug(string, ...any)
}) bool {
	gw := n.pool.gateway.AsSlice()
	mods := []dhcpv4.Modifier{
		dhcpv4.WithMessageType(mt),
		dhcpv4.WithOption(dhcpv4.OptServerIdentifier(gw)),
	}
	if mt != dhcpv4.MessageTypeNak {
		mods = append(mods,
			dhcpv4.WithYourIP(addr.AsSlice()),
			dhcpv4.WithServerIP(gw),
			dhcpv4.WithNetmask(n.pool.mask()),
			dhcpv4.WithRouter(gw),
			dhcpv4.WithLeaseTime(uint32(n.cfg.LeaseTime/time.Second)),
		)
		if len(n.announce) > 0 {
			dns := make([]net.IP, len(n.announce))
			for i, a := range n.announce {
				dns[i] = a.AsSlice()
			}
			mods = append(mods, dhcpv4.WithDNS(dns...))
		}
	}
	resp, err := dhcpv4.NewReplyFromRequest(req, mods...)
	if err != nil {
		log.Warn("dhcp: build reply", "err", err)
		return false
	}
	if _, err := conn.WriteTo(resp.ToBytes(), peer); err != nil {
		log.Warn("dhcp: send reply", "err", err, "to", peer)
		return false
	}
	log.Debug("dhcp: replied", "reply", mt.String())
	return true
}

// markAcked records the latest ACK of the VM's current MAC durably. Every
// ACK is kept (a guest asks at boot and at each renewal, so this is rare):
// its time is what tells a lease from this boot from one a previous boot of
// the guest took, which is what "ready" must mean after a restart.
func (n *Network) markAcked(vmID, mac string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	l, ok := n.leases[vmID]
	if !ok || l.MAC != mac {
		return
	}
	first := l.AckedAt == nil
	now := time.Now().UTC()
	l.AckedAt = &now
	if err := n.saveLocked(); err != nil {
		// LeasedAt reports it in this process anyway; the next ACK (the
		// guest renews at half the lease time) retries the write.
		n.log.Warn("dhcp: persist lease", "vm", vmID, "err", err)
	}
	if first {
		n.log.Info("guest took its address", "vm", vmID, "addr", l.Addr)
	}
}
