package exposeproxy

import (
	"encoding/binary"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Datagrams move in batches through recvmmsg and sendmmsg: one system call
// and one wake-up for everything queued, instead of one of each per datagram.
// These are direct calls on x/sys/unix rather than golang.org/x/net/ipv4's
// ReadBatch, which allocates a *net.UDPAddr for every datagram it reads; here
// the headers, addresses and buffers are built once and reused, so the steady
// path allocates nothing.

// maxDatagram holds any UDP payload IPv4 or IPv6 (without jumbograms) carries.
const maxDatagram = 64 << 10

// batchSize is how many datagrams one call moves at most.
const batchSize = 16

// batch is a goroutine's working set while it has datagrams in hand: the
// receive buffers and headers, and the scratch to send them on. Batches are
// pooled and taken only once a socket is readable (see reader), so an idle
// exposure or a quiet session holds none of this megabyte.
type batch struct {
	buf   []byte // batchSize slots of maxDatagram
	rhs   [batchSize]unix.Mmsghdr
	riov  [batchSize]unix.Iovec
	names [batchSize]unix.RawSockaddrInet6
	n     int // datagrams the last read filled

	groups [batchSize]group
	gs     []*group

	out sender
}

var batchPool = sync.Pool{New: func() any {
	b := &batch{buf: make([]byte, batchSize*maxDatagram)}
	for i := range b.rhs {
		b.riov[i].Base = &b.buf[i*maxDatagram]
		b.riov[i].SetLen(maxDatagram)
		b.rhs[i].Hdr.Iov = &b.riov[i]
		b.rhs[i].Hdr.SetIovlen(1)
		b.rhs[i].Hdr.Name = (*byte)(unsafe.Pointer(&b.names[i]))
	}
	b.out.init()
	b.gs = make([]*group, 0, batchSize)
	return b
}}

// data is datagram i of the last read.
func (b *batch) data(i int) []byte {
	return b.buf[i*maxDatagram : i*maxDatagram+int(b.rhs[i].Len)]
}

// from is the sender of datagram i of the last read.
func (b *batch) from(i int) netip.AddrPort {
	return sockaddrToAddrPort(&b.names[i], b.rhs[i].Hdr.Namelen)
}

// recvmmsg fills the batch from fd without blocking.
func (b *batch) recvmmsg(fd uintptr) (int, syscall.Errno) {
	for i := range b.rhs {
		b.rhs[i].Hdr.Namelen = unix.SizeofSockaddrInet6
		b.rhs[i].Hdr.Flags = 0
		b.rhs[i].Len = 0
	}
	for {
		n, _, e := unix.Syscall6(unix.SYS_RECVMMSG, fd, uintptr(unsafe.Pointer(&b.rhs[0])),
			batchSize, unix.MSG_DONTWAIT, 0, 0)
		if e == unix.EINTR {
			continue
		}
		if e != 0 {
			return 0, e
		}
		return int(n), 0
	}
}

// reader receives batches from one socket. It takes a batch from the pool
// only when the socket has something to read and hands it back before
// waiting, so waiting costs no buffer.
type reader struct {
	rc   syscall.RawConn
	b    *batch
	errc syscall.Errno
	try  func(fd uintptr) bool // r.recv, bound once so a read allocates no closure
}

func newReader(rc syscall.RawConn) *reader {
	r := &reader{rc: rc}
	r.try = r.recv
	return r
}

func (r *reader) recv(fd uintptr) bool {
	if r.b == nil {
		r.b = batchPool.Get().(*batch)
	}
	n, e := r.b.recvmmsg(fd)
	if e == unix.EAGAIN {
		r.release()
		return false // wait for readability, then try again
	}
	r.b.n, r.errc = n, e
	return true
}

// read waits for at least one datagram and returns the batch holding
// everything that was queued (up to batchSize). The batch stays the reader's
// until the next read or release.
func (r *reader) read() (*batch, error) {
	r.errc = 0
	if err := r.rc.Read(r.try); err != nil {
		r.release()
		return nil, err
	}
	if r.errc != 0 {
		r.release()
		return nil, os.NewSyscallError("recvmmsg", r.errc)
	}
	return r.b, nil
}

func (r *reader) release() {
	if r.b != nil {
		batchPool.Put(r.b)
		r.b = nil
	}
}

// sender sends up to batchSize datagrams on one socket with sendmmsg,
// waiting for writability as a blocking write would.
type sender struct {
	hs   [batchSize]unix.Mmsghdr
	iov  [batchSize]unix.Iovec
	n    int           // datagrams queued
	off  int           // datagrams sent so far
	errc syscall.Errno // why datagram off could not be sent
	try  func(fd uintptr) bool
}

func (s *sender) init() { s.try = s.send }

// add queues p, to be sent to name (nil on a connected socket). p must stay
// untouched until flush returns.
func (s *sender) add(p []byte, name *unix.RawSockaddrInet6, namelen uint32) {
	i := s.n
	s.iov[i].Base = unsafe.SliceData(p)
	s.iov[i].SetLen(len(p))
	s.hs[i].Hdr.Iov = &s.iov[i]
	s.hs[i].Hdr.SetIovlen(1)
	s.hs[i].Hdr.Name = (*byte)(unsafe.Pointer(name))
	s.hs[i].Hdr.Namelen = namelen
	s.n++
}

func (s *sender) full() bool { return s.n == batchSize }

// size is the payload of queued datagrams from up to to, read from the
// lengths already in hand rather than asked of the kernel again.
func (s *sender) size(from, to int) int64 {
	var n int64
	for i := from; i < to; i++ {
		n += int64(s.iov[i].Len)
	}
	return n
}

func (s *sender) send(fd uintptr) bool {
	for s.off < s.n {
		n, _, e := unix.Syscall6(unix.SYS_SENDMMSG, fd, uintptr(unsafe.Pointer(&s.hs[s.off])),
			uintptr(s.n-s.off), 0, 0, 0)
		switch e {
		case 0:
			s.off += int(n)
		case unix.EINTR:
		case unix.EAGAIN:
			return false // wait for room in the send buffer
		default:
			s.errc = e
			return true
		}
	}
	return true
}

// flush sends what is queued and returns how many datagrams left. When that
// is fewer than were queued, err says why the next one could not go; the
// caller decides whether to skip it and flush the rest (flushFrom).
func (s *sender) flush(rc syscall.RawConn) (int, error) { return s.flushFrom(rc, 0) }

// flushFrom sends queued datagrams from index i on.
func (s *sender) flushFrom(rc syscall.RawConn, i int) (int, error) {
	s.off, s.errc = i, 0
	if err := rc.Write(s.try); err != nil {
		return s.off, err
	}
	if s.errc != 0 {
		return s.off, os.NewSyscallError("sendmmsg", s.errc)
	}
	return s.off, nil
}

func (s *sender) reset() { s.n, s.off = 0, 0 }

// sockaddrToAddrPort reads an address recvmmsg wrote. The zone of a
// link-local IPv6 sender is not kept: the key only tells clients apart, and
// replies go to the raw address, which keeps it.
func sockaddrToAddrPort(sa *unix.RawSockaddrInet6, n uint32) netip.AddrPort {
	switch sa.Family {
	case unix.AF_INET:
		if n < unix.SizeofSockaddrInet4 {
			return netip.AddrPort{}
		}
		v4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(sa))
		return netip.AddrPortFrom(netip.AddrFrom4(v4.Addr), portOf(v4.Port))
	case unix.AF_INET6:
		if n < unix.SizeofSockaddrInet6 {
			return netip.AddrPort{}
		}
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), portOf(sa.Port))
	}
	return netip.AddrPort{}
}

// portOf turns a sockaddr's network-order port into a number.
func portOf(raw uint16) uint16 {
	return binary.BigEndian.Uint16((*[2]byte)(unsafe.Pointer(&raw))[:])
}
