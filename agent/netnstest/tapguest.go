package netnstest

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TapGuest stands in for a guest on a tap: it attaches to the tap the way
// QEMU does and writes whatever Ethernet frames a test builds, so a test can
// send what a hostile guest would without teaching a real guest to. It
// answers ARP requests for its own address (so the host and its peers can
// reach it) and keeps every other frame it receives for WaitFor and Count.
type TapGuest struct {
	Name string
	MAC  net.HardwareAddr
	IP   netip.Addr

	f *os.File

	mu       sync.Mutex
	received []Frame
	arrived  chan struct{} // closed and replaced on every new frame
}

// OpenTap attaches to the existing tap name (single queue, no packet info,
// as netsetup makes them) and waits until the bridge port carries traffic.
// The tap is released when the test ends.
func OpenTap(t *testing.T, name string, mac net.HardwareAddr, ip netip.Addr) *TapGuest {
	t.Helper()
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	require.NoError(t, err, "open /dev/net/tun")
	ifr, err := unix.NewIfreq(name)
	require.NoError(t, err)
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		require.NoError(t, err, "attach to tap %s", name)
	}
	// A non-blocking descriptor gets a pollable File, so Close interrupts
	// the reader below.
	g := &TapGuest{Name: name, MAC: mac, IP: ip, f: os.NewFile(uintptr(fd), name), arrived: make(chan struct{})}
	done := make(chan struct{})
	go g.read(done)
	t.Cleanup(func() {
		g.f.Close()
		<-done
	})
	require.Eventually(t, func() bool {
		l, err := netlink.LinkByName(name)
		return err == nil && l.Attrs().OperState == netlink.OperUp
	}, 5*time.Second, 20*time.Millisecond, "tap %s never came up once attached", name)
	return g
}

func (g *TapGuest) read(done chan struct{}) {
	defer close(done)
	buf := make([]byte, 65536)
	for {
		n, err := g.f.Read(buf)
		if err != nil {
			if errors.Is(err, os.ErrClosed) {
				return
			}
			time.Sleep(10 * time.Millisecond)
			continue
		}
		fr := ParseFrame(slices.Clone(buf[:n]))
		if fr.Type == EtherTypeARP && fr.ARPOp == 1 && fr.TPA == g.IP {
			_, _ = g.f.Write(EthernetFrame(fr.Src, g.MAC, EtherTypeARP, ARP(2, g.MAC, g.IP, fr.SHA, fr.SPA)))
			continue
		}
		g.mu.Lock()
		g.received = append(g.received, fr)
		close(g.arrived)
		g.arrived = make(chan struct{})
		g.mu.Unlock()
	}
}

// Send writes one frame onto the tap, as the guest's NIC would.
func (g *TapGuest) Send(t *testing.T, frame []byte) {
	t.Helper()
	_, err := g.f.Write(frame)
	require.NoError(t, err, "write to tap %s", g.Name)
}

// WaitFor returns the first frame received so far or within the time given
// that matches.
func (g *TapGuest) WaitFor(within time.Duration, match func(Frame) bool) (Frame, bool) {
	deadline := time.After(within)
	seen := 0
	for {
		g.mu.Lock()
		frames, arrived := g.received[seen:], g.arrived
		seen = len(g.received)
		g.mu.Unlock()
		for _, fr := range frames {
			if match(fr) {
				return fr, true
			}
		}
		select {
		case <-arrived:
		case <-deadline:
			return Frame{}, false
		}
	}
}

// Count is how many frames received so far match.
func (g *TapGuest) Count(match func(Frame) bool) int {
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for _, fr := range g.received {
		if match(fr) {
			n++
		}
	}
	return n
}

// Ether types a test sends and reads.
const (
	EtherTypeIPv4 = 0x0800
	EtherTypeARP  = 0x0806
	EtherTypeIPv6 = 0x86dd
)

// Broadcast is the Ethernet broadcast address.
var Broadcast = net.HardwareAddr{0xff, 0xff, 0xff, 0xff, 0xff, 0xff}

// Frame is a received frame, decoded as far as the tests need: Ethernet,
// then ARP, or IPv4 or IPv6 (without extension headers) with UDP or TCP.
type Frame struct {
	Raw      []byte
	Dst, Src net.HardwareAddr
	Type     uint16

	ARPOp    uint16
	SHA      net.HardwareAddr
	SPA, TPA netip.Addr

	IPSrc, IPDst     netip.Addr
	Proto            uint8 // 6 TCP, 17 UDP
	SrcPort, DstPort uint16
	TCPFlags         uint8
	Payload          []byte // UDP payload
}

// ParseFrame decodes what it can of b; fields it cannot reach stay zero.
func ParseFrame(b []byte) Frame {
	fr := Frame{Raw: b}
	if len(b) < 14 {
		return fr
	}
	fr.Dst, fr.Src, fr.Type = net.HardwareAddr(b[0:6]), net.HardwareAddr(b[6:12]), binary.BigEndian.Uint16(b[12:14])
	p := b[14:]
	switch fr.Type {
	case EtherTypeARP:
		if len(p) >= 28 {
			fr.ARPOp = binary.BigEndian.Uint16(p[6:8])
			fr.SHA = net.HardwareAddr(p[8:14])
			fr.SPA = netip.AddrFrom4([4]byte(p[14:18]))
			fr.TPA = netip.AddrFrom4([4]byte(p[24:28]))
		}
	case EtherTypeIPv4:
		if len(p) < 20 {
			return fr
		}
		ihl := int(p[0]&0x0f) * 4
		fr.Proto = p[9]
		fr.IPSrc = netip.AddrFrom4([4]byte(p[12:16]))
		fr.IPDst = netip.AddrFrom4([4]byte(p[16:20]))
		if len(p) >= ihl {
			fr.parseL4(p[ihl:])
		}
	case EtherTypeIPv6:
		if len(p) < 40 {
			return fr
		}
		fr.Proto = p[6]
		fr.IPSrc = netip.AddrFrom16([16]byte(p[8:24]))
		fr.IPDst = netip.AddrFrom16([16]byte(p[24:40]))
		fr.parseL4(p[40:])
	}
	return fr
}

func (fr *Frame) parseL4(l4 []byte) {
	if len(l4) < 8 {
		return
	}
	fr.SrcPort, fr.DstPort = binary.BigEndian.Uint16(l4[0:2]), binary.BigEndian.Uint16(l4[2:4])
	switch fr.Proto {
	case 17:
		fr.Payload = l4[8:]
	case 6:
		if len(l4) >= 14 {
			fr.TCPFlags = l4[13]
		}
	}
}

// EthernetFrame builds a frame around payload.
func EthernetFrame(dst, src net.HardwareAddr, etherType uint16, payload []byte) []byte {
	b := make([]byte, 0, 14+len(payload))
	b = append(b, dst...)
	b = append(b, src...)
	b = binary.BigEndian.AppendUint16(b, etherType)
	return append(b, payload...)
}

// ARP builds an Ethernet/IPv4 ARP packet (op 1 request, 2 reply).
func ARP(op uint16, sha net.HardwareAddr, spa netip.Addr, tha net.HardwareAddr, tpa netip.Addr) []byte {
	b := []byte{0, 1, 8, 0, 6, 4}
	b = binary.BigEndian.AppendUint16(b, op)
	b = append(b, sha...)
	b = append(b, spa.AsSlice()...)
	if tha == nil {
		tha = make(net.HardwareAddr, 6)
	}
	b = append(b, tha...)
	return append(b, tpa.AsSlice()...)
}

// UDP4 builds an IPv4 packet carrying one UDP datagram (no UDP checksum,
// which IPv4 allows).
func UDP4(src, dst netip.AddrPort, payload []byte) []byte {
	udp := binary.BigEndian.AppendUint16(nil, src.Port())
	udp = binary.BigEndian.AppendUint16(udp, dst.Port())
	udp = binary.BigEndian.AppendUint16(udp, uint16(8+len(payload)))
	udp = append(udp, 0, 0)
	udp = append(udp, payload...)

	ip := []byte{0x45, 0}
	ip = binary.BigEndian.AppendUint16(ip, uint16(20+len(udp)))
	ip = append(ip, 0, 0, 0x40, 0, 64, 17, 0, 0) // id, DF, ttl, udp, checksum
	ip = append(ip, src.Addr().AsSlice()...)
	ip = append(ip, dst.Addr().AsSlice()...)
	binary.BigEndian.PutUint16(ip[10:12], checksum(ip))
	return append(ip, udp...)
}

// UDP6 builds an IPv6 packet carrying one UDP datagram.
func UDP6(src, dst netip.AddrPort, payload []byte) []byte {
	udp := binary.BigEndian.AppendUint16(nil, src.Port())
	udp = binary.BigEndian.AppendUint16(udp, dst.Port())
	udp = binary.BigEndian.AppendUint16(udp, uint16(8+len(payload)))
	udp = append(udp, 0, 0)
	udp = append(udp, payload...)
	pseudo := slices.Concat(src.Addr().AsSlice(), dst.Addr().AsSlice(),
		binary.BigEndian.AppendUint32(nil, uint32(len(udp))), []byte{0, 0, 0, 17}, udp)
	binary.BigEndian.PutUint16(udp[6:8], checksum(pseudo))

	ip := []byte{0x60, 0, 0, 0}
	ip = binary.BigEndian.AppendUint16(ip, uint16(len(udp)))
	ip = append(ip, 17, 255)
	ip = append(ip, src.Addr().AsSlice()...)
	ip = append(ip, dst.Addr().AsSlice()...)
	return append(ip, udp...)
}

func checksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	return ^uint16(sum)
}
