// Package netsetup gives guests their network: a host bridge with NAT for
// egress, one tap per VM enslaved to it, an embedded DHCP server that
// hands each VM a stable address the agent chose and knows, a DNS
// forwarder (dns.go) and a phone-home endpoint (phonehome.go) on the
// bridge address, and a guest filter (filter.go) that keeps guests from
// taking each other's addresses and lets only guests of one owner reach
// each other.
//
// It works in the network namespace of the calling process.
package netsetup

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/insomniacslk/dhcp/dhcpv4/server4"
	"github.com/vishvananda/netlink"
)

const (
	DefaultBridge    = "eitri0"
	defaultLeaseTime = time.Hour
)

// DefaultPrefix is the guest network; the gateway (the bridge's own
// address) is its first address.
var DefaultPrefix = netip.MustParsePrefix("10.77.0.1/24")

// Config configures the host network.
type Config struct {
	// Bridge is the bridge's name (default eitri0).
	Bridge string
	// Prefix is the guest network (default 10.77.0.1/24). The gateway is its
	// first host address, guests get the following ones.
	Prefix netip.Prefix
	// LeaseFile persists the VM→address table. Required.
	LeaseFile string
	// DNS servers to announce over DHCP instead of the forwarder. Empty (the
	// default) runs a DNS forwarder on the bridge address and announces it.
	DNS []netip.Addr
	// DNSUpstreams are the resolvers the forwarder relays to. Empty reads
	// the host's ResolvConf (default /etc/resolv.conf) as it changes.
	DNSUpstreams []netip.AddrPort
	ResolvConf   string
	// PhoneHomePort is the phone-home endpoint's port on the bridge address
	// (default DefaultPhoneHomePort).
	PhoneHomePort uint16
	// HostCerts returns the SSH host certificate this host holds for a
	// VM's guest ("": none), which the endpoint serves to that guest alone
	// (HostCertURL). Nil: guests are given no URL for one.
	HostCerts func(vmID string) string
	// LeaseTime is the DHCP lease time (default 1h).
	LeaseTime time.Duration
	// Teardown makes Close also delete the bridge, the NAT table and the
	// guest filter. By default they stay: they belong to the host and
	// running guests need them while the agent restarts.
	Teardown bool
	Log      *slog.Logger
}

// Network is the set-up host network.
type Network struct {
	cfg  Config
	log  *slog.Logger
	pool pool

	mu     sync.Mutex
	leases map[string]*lease // by VM id
	byMAC  map[string]*lease // by MAC (net.HardwareAddr.String())
	// unsaved is set while the lease file lags the table (a failed write).
	unsaved bool

	srv       *server4.Server
	serveDone chan struct{}
	// dns is the forwarder, nil when Config.DNS replaces it or it could not
	// bind; announce is what DHCP offers as resolvers.
	dns      *dnsForwarder
	announce []netip.Addr

	phoneKey  []byte
	phonePort uint16
	phoneSrv  *http.Server
	phoneDone chan struct{}
	closeOnce sync.Once
	closeErr  error
}

// Setup makes the host network exist and starts the DHCP server. It is
// idempotent: whatever already exists is reused and put right.
func Setup(ctx context.Context, cfg Config) (*Network, error) {
	if cfg.Bridge == "" {
		cfg.Bridge = DefaultBridge
	}
	if !cfg.Prefix.IsValid() {
		cfg.Prefix = DefaultPrefix
	}
	if cfg.ResolvConf == "" {
		cfg.ResolvConf = DefaultResolvConf
	}
	if cfg.PhoneHomePort == 0 {
		cfg.PhoneHomePort = DefaultPhoneHomePort
	}
	if cfg.LeaseTime <= 0 {
		cfg.LeaseTime = defaultLeaseTime
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.LeaseFile == "" {
		return nil, errors.New("netsetup: Config.LeaseFile is required")
	}
	if len(cfg.Bridge) > 15 {
		return nil, fmt.Errorf("netsetup: bridge name %q is longer than 15 bytes", cfg.Bridge)
	}
	p, err := newPool(cfg.Prefix)
	if err != nil {
		return nil, err
	}
	n := &Network{
		cfg:    cfg,
		log:    cfg.Log.With("component", "netsetup", "bridge", cfg.Bridge),
		pool:   p,
		leases: map[string]*lease{},
		byMAC:  map[string]*lease{},

		phonePort: cfg.PhoneHomePort,
	}
	if err := n.load(); err != nil {
		return nil, err
	}
	if n.phoneKey, err = loadOrCreateKey(filepath.Dir(cfg.LeaseFile)); err != nil {
		return nil, err
	}

	steps := []struct {
		name string
		fn   func() error
	}{
		{"bridge", n.ensureBridge},
		{"forwarding", enableForwarding},
		{"nat", func() error { return ensureNAT(p.prefix, cfg.Bridge) }},
		{"guest filter", n.syncFilter},
		{"dns", n.startDNS},
		{"phone home", n.startPhoneHomeOrWarn},
		{"dhcp", n.startDHCP},
	}
	for _, s := range steps {
		if err := ctx.Err(); err != nil {
			n.Close()
			return nil, err
		}
		if err := s.fn(); err != nil {
			n.Close()
			return nil, err
		}
	}
	n.log.Info("host network ready", "gateway", p.gateway, "prefix", p.prefix, "leases", len(n.leases), "dns", n.announce)
	return n, nil
}

// Gateway is the bridge's address: the guests' router.
func (n *Network) Gateway() netip.Addr { return n.pool.gateway }

func (n *Network) load() error {
	leases, err := loadLeases(n.cfg.LeaseFile)
	if err != nil {
		return err
	}
	for _, l := range leases {
		mac, err := net.ParseMAC(l.MAC)
		if err != nil || !n.pool.contains(l.Addr) || n.byAddr(l.Addr) != nil {
			// The prefix changed or the entry is damaged: the VM gets a
			// fresh address at its next Allocate.
			n.log.Warn("dropping lease outside the pool", "vm", l.VMID, "addr", l.Addr, "mac", l.MAC)
			continue
		}
		l.MAC = mac.String()
		n.leases[l.VMID] = l
		n.byMAC[l.MAC] = l
	}
	return nil
}

func (n *Network) byAddr(a netip.Addr) *lease {
	for _, l := range n.leases {
		if l.Addr == a {
			return l
		}
	}
	return nil
}

func (n *Network) ensureBridge() error {
	name := n.cfg.Bridge
	link, err := netlink.LinkByName(name)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
		br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: name}}
		if err := netlink.LinkAdd(br); err != nil {
			return fmt.Errorf("netsetup: create bridge %s: %w", name, err)
		}
		if link, err = netlink.LinkByName(name); err != nil {
			return fmt.Errorf("netsetup: bridge %s: %w", name, err)
		}
		n.log.Info("created bridge")
	case err != nil:
		return fmt.Errorf("netsetup: bridge %s: %w", name, err)
	case link.Type() != "bridge":
		return fmt.Errorf("netsetup: %s exists and is a %s, not a bridge", name, link.Type())
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: n.pool.gateway.AsSlice(), Mask: n.pool.mask()}}
	if err := netlink.AddrReplace(link, addr); err != nil {
		return fmt.Errorf("netsetup: address bridge %s: %w", name, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("netsetup: bring up bridge %s: %w", name, err)
	}
	return nil
}

// AddTap creates a persistent tap for one VM (single queue, which is what a
// QEMU netdev without queues= opens), enslaves it to the bridge and brings
// it up. An existing tap is reused. The guest filter is written again
// before the tap comes up (which also restores it if someone flushed the
// host's ruleset); a tap carries traffic only if it is TapName of a VM that
// holds a lease.
func (n *Network) AddTap(name string) error {
	if name == "" || len(name) > 15 {
		return fmt.Errorf("netsetup: tap name %q must be 1 to 15 bytes", name)
	}
	br, err := netlink.LinkByName(n.cfg.Bridge)
	if err != nil {
		return fmt.Errorf("netsetup: bridge %s: %w", n.cfg.Bridge, err)
	}
	link, err := netlink.LinkByName(name)
	var notFound netlink.LinkNotFoundError
	switch {
	case errors.As(err, &notFound):
		tap := &netlink.Tuntap{
			LinkAttrs: netlink.LinkAttrs{Name: name, MasterIndex: br.Attrs().Index},
			Mode:      netlink.TUNTAP_MODE_TAP,
			Flags:     netlink.TUNTAP_NO_PI,
		}
		if err := netlink.LinkAdd(tap); err != nil {
			return fmt.Errorf("netsetup: create tap %s: %w", name, err)
		}
		if link, err = netlink.LinkByName(name); err != nil {
			return fmt.Errorf("netsetup: tap %s: %w", name, err)
		}
	case err != nil:
		return fmt.Errorf("netsetup: tap %s: %w", name, err)
	case link.Type() != "tuntap":
		return fmt.Errorf("netsetup: %s exists and is a %s, not a tap", name, link.Type())
	}
	if link.Attrs().MasterIndex != br.Attrs().Index {
		if err := netlink.LinkSetMaster(link, br); err != nil {
			return fmt.Errorf("netsetup: enslave tap %s: %w", name, err)
		}
	}
	if err := n.syncFilter(); err != nil {
		return err
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("netsetup: bring up tap %s: %w", name, err)
	}
	n.log.Debug("tap ready", "tap", name)
	return nil
}

// RemoveTap deletes a tap; a tap that does not exist is fine.
func (n *Network) RemoveTap(name string) error {
	link, err := netlink.LinkByName(name)
	var notFound netlink.LinkNotFoundError
	if errors.As(err, &notFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("netsetup: tap %s: %w", name, err)
	}
	if link.Type() != "tuntap" {
		return fmt.Errorf("netsetup: refusing to delete %s: it is a %s, not a tap", name, link.Type())
	}
	if err := netlink.LinkDel(link); err != nil {
		return fmt.Errorf("netsetup: delete tap %s: %w", name, err)
	}
	n.log.Debug("tap removed", "tap", name)
	return nil
}

// tapPrefix begins the name of every tap eitri makes; the guest filter
// knows eitri's bridge ports by it.
const tapPrefix = "eitri"

// TapName derives a VM's tap name: interface names are at most 15 bytes,
// VM ids are longer, so it is a short hash.
func TapName(vmID string) string {
	h := sha256.Sum256([]byte(vmID))
	return fmt.Sprintf("%s%x", tapPrefix, h[:5])
}

// MAC derives a stable, locally administered unicast MAC for a VM, so the
// address survives the VM being recreated on this host.
func MAC(vmID string) net.HardwareAddr {
	h := sha256.Sum256([]byte("eitri-mac:" + vmID))
	mac := net.HardwareAddr(h[:6])
	mac[0] = mac[0]&0xfc | 0x02 // locally administered, unicast
	return mac
}

// Allocate returns the VM's address, reserving the lowest free one the first
// time. The reservation is written to the lease file before it is returned,
// so it survives restarts. A VM whose MAC changed keeps its address, but the
// new NIC has to ask for it again before Leased reports true.
//
// owner is the VM's tenant key: guests with the same non-empty owner may
// reach each other, any other guest pair never does. The guest filter
// follows every change of the table.
func (n *Network) Allocate(vmID string, mac net.HardwareAddr, owner string) (netip.Addr, error) {
	if vmID == "" {
		return netip.Addr{}, errors.New("netsetup: empty vm id")
	}
	if len(mac) != 6 {
		return netip.Addr{}, fmt.Errorf("netsetup: vm %s: invalid MAC %q", vmID, mac)
	}
	key := mac.String()
	n.mu.Lock()
	defer n.mu.Unlock()
	if other, ok := n.byMAC[key]; ok && other.VMID != vmID {
		return netip.Addr{}, fmt.Errorf("netsetup: MAC %s already belongs to vm %s", key, other.VMID)
	}
	if l, ok := n.leases[vmID]; ok {
		if l.MAC == key && l.Owner == owner {
			return l.Addr, nil
		}
		old := *l
		if l.MAC != key {
			delete(n.byMAC, l.MAC)
			l.MAC, l.AckedAt = key, nil
			n.byMAC[key] = l
		}
		l.Owner = owner
		if err := n.saveLocked(); err != nil {
			delete(n.byMAC, key)
			*l = old
			n.byMAC[old.MAC] = l
			return netip.Addr{}, err
		}
		if old.Owner != owner {
			n.log.Info("vm owner changed", "vm", vmID, "owner", owner, "was", old.Owner)
		}
		return l.Addr, n.syncFilterLocked()
	}
	addr, ok := n.freeLocked()
	if !ok {
		return netip.Addr{}, ErrPoolExhausted
	}
	l := &lease{VMID: vmID, MAC: key, Addr: addr, Owner: owner}
	n.leases[vmID], n.byMAC[key] = l, l
	if err := n.saveLocked(); err != nil {
		delete(n.leases, vmID)
		delete(n.byMAC, key)
		return netip.Addr{}, err
	}
	n.log.Info("address allocated", "vm", vmID, "addr", addr, "mac", key, "owner", owner)
	return addr, n.syncFilterLocked()
}

// SetOwner changes the owner of a VM that holds a lease, and the guest
// filter with it; a VM without one is left for its next Allocate.
func (n *Network) SetOwner(vmID, owner string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	l, ok := n.leases[vmID]
	if !ok || l.Owner == owner {
		return nil
	}
	old := l.Owner
	l.Owner = owner
	if err := n.saveLocked(); err != nil {
		l.Owner = old
		return err
	}
	n.log.Info("vm owner changed", "vm", vmID, "owner", owner, "was", old)
	return n.syncFilterLocked()
}

func (n *Network) freeLocked() (netip.Addr, bool) {
	used := make(map[netip.Addr]bool, len(n.leases))
	for _, l := range n.leases {
		used[l.Addr] = true
	}
	for a := n.pool.gateway.Next(); n.pool.contains(a); a = a.Next() {
		if !used[a] {
			return a, true
		}
	}
	return netip.Addr{}, false
}

// Release frees the VM's address. Releasing an unknown VM is fine.
func (n *Network) Release(vmID string) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	l, ok := n.leases[vmID]
	if !ok {
		return nil
	}
	delete(n.leases, vmID)
	delete(n.byMAC, l.MAC)
	if err := n.saveLocked(); err != nil {
		n.leases[vmID], n.byMAC[l.MAC] = l, l
		return err
	}
	n.log.Info("address released", "vm", vmID, "addr", l.Addr)
	return n.syncFilterLocked()
}

// Leased returns the VM's address and whether its guest has accepted it
// over DHCP (a DHCPACK was sent to it).
func (n *Network) Leased(vmID string) (netip.Addr, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	l, ok := n.leases[vmID]
	if !ok {
		return netip.Addr{}, false
	}
	return l.Addr, l.AckedAt != nil
}

// LeasedAt is Leased with the time of the guest's latest DHCPACK, so a
// caller can tell a lease taken since the guest last booted from an old one.
func (n *Network) LeasedAt(vmID string) (netip.Addr, time.Time, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	l, ok := n.leases[vmID]
	if !ok || l.AckedAt == nil {
		return netip.Addr{}, time.Time{}, false
	}
	return l.Addr, *l.AckedAt, true
}

func (n *Network) saveLocked() error {
	list := make([]*lease, 0, len(n.leases))
	for _, l := range n.leases {
		list = append(list, l)
	}
	slices.SortFunc(list, func(a, b *lease) int { return a.Addr.Compare(b.Addr) })
	err := saveLeases(n.cfg.LeaseFile, list)
	n.unsaved = err != nil
	return err
}

// Close stops the DHCP, DNS and phone-home servers. The bridge, NAT and guest filter stay
// (running guests still use them) unless Config.Teardown is set.
func (n *Network) Close() error {
	n.closeOnce.Do(func() {
		var errs []error
		if n.srv != nil {
			errs = append(errs, n.srv.Close())
			<-n.serveDone
		}
		if n.dns != nil {
			errs = append(errs, n.dns.close())
		}
		if n.phoneSrv != nil {
			errs = append(errs, n.phoneSrv.Close())
			<-n.phoneDone
		}
		if n.cfg.Teardown {
			errs = append(errs, removeNAT(), removeFilter())
			if link, err := netlink.LinkByName(n.cfg.Bridge); err == nil {
				if err := netlink.LinkDel(link); err != nil {
					errs = append(errs, fmt.Errorf("netsetup: delete bridge: %w", err))
				}
			}
			n.log.Info("host network torn down")
		}
		n.closeErr = errors.Join(errs...)
	})
	return n.closeErr
}
