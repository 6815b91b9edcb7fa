package exposeproxy

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// sinkGuest swallows everything and answers the client's FIN with one byte,
// so the sender knows every byte crossed.
func sinkGuest(tb testing.TB) uint16 {
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(loopback, 0)))
	require.NoError(tb, err)
	tb.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.AcceptTCP()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(io.Discard, c)
				c.Write([]byte{1})
			}()
		}
	}()
	return tcpPort(ln)
}

// benchTarget returns where a benchmark's client dials: straight at the
// guest, or through a proxy exposure.
func benchTarget(b *testing.B, via string, proto Protocol, guestPort uint16) netip.AddrPort {
	if via == "direct" {
		return netip.AddrPortFrom(loopback, guestPort)
	}
	p := New(Config{Resolve: newGuests("vm1", loopback).resolve, MaxConns: 1 << 16})
	b.Cleanup(p.Close)
	s := tcpSpec("e1", "vm1", guestPort)
	s.Protocol = proto
	st := p.Converge([]Spec{s})
	require.Equal(b, StateActive, st[0].State, st[0].Reason)
	return st[0].Bound
}

func BenchmarkTCPThroughput(b *testing.B) {
	chunk := make([]byte, 256<<10)
	for _, via := range []string{"direct", "proxy"} {
		b.Run(via, func(b *testing.B) {
			to := benchTarget(b, via, TCP, sinkGuest(b))
			c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(to))
			require.NoError(b, err)
			defer c.Close()
			b.SetBytes(int64(len(chunk)))
			b.ResetTimer()
			for range b.N {
				if _, err := c.Write(chunk); err != nil {
					b.Fatal(err)
				}
			}
			c.CloseWrite()
			if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
				b.Fatal("sink never confirmed:", err)
			}
		})
	}
}

// BenchmarkTCPConnect is the short-connection rate: connect, one byte each
// way, close.
func BenchmarkTCPConnect(b *testing.B) {
	for _, via := range []string{"direct", "proxy"} {
		b.Run(via, func(b *testing.B) {
			to := benchTarget(b, via, TCP, echoGuest(b))
			one := make([]byte, 1)
			b.ResetTimer()
			for range b.N {
				c, err := net.DialTCP("tcp", nil, net.TCPAddrFromAddrPort(to))
				if err != nil {
					b.Fatal(err)
				}
				c.Write(one)
				if _, err := io.ReadFull(c, one); err != nil {
					b.Fatal(err)
				}
				c.Close()
			}
		})
	}
}

// BenchmarkUDPRoundTrip: one client, request/response through one session.
func BenchmarkUDPRoundTrip(b *testing.B) {
	for _, via := range []string{"direct", "proxy"} {
		b.Run(via, func(b *testing.B) {
			to := benchTarget(b, via, UDP, udpGuest(b, netip.AddrPortFrom(loopback, 0), "e"))
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
			require.NoError(b, err)
			defer c.Close()
			msg, buf := make([]byte, 512), make([]byte, 2048)
			b.SetBytes(int64(len(msg)))
			b.ResetTimer()
			for range b.N {
				c.Write(msg)
				if _, err := c.Read(buf); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkUDPWindow: clients that each keep window datagrams in flight
// against an echo, the load compare.sh's udpload puts on a published port.
// One op is one answered datagram; allocs/op is the proxy's cost per datagram
// (the clients and the echo allocate nothing). A datagram unanswered for a
// second counts as lost, reported as loss%.
func BenchmarkUDPWindow(b *testing.B) {
	const window = 32
	for _, clients := range []int{1, 4} {
		for _, via := range []string{"direct", "proxy"} {
			b.Run(fmt.Sprintf("%s/clients=%d", via, clients), func(b *testing.B) {
				to := benchTarget(b, via, UDP, udpEchoGuest(b))
				conns := make([]*net.UDPConn, clients)
				for i := range conns {
					c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(to))
					require.NoError(b, err)
					b.Cleanup(func() { c.Close() })
					conns[i] = c
				}
				var sent, lost atomic.Int64
				var wg sync.WaitGroup
				b.ReportAllocs()
				b.ResetTimer()
				for i, c := range conns {
					share := b.N / clients
					if i == 0 {
						share += b.N % clients
					}
					wg.Add(1)
					go func() {
						defer wg.Done()
						s, l := windowLoad(c, share, window)
						sent.Add(int64(s))
						lost.Add(int64(l))
					}()
				}
				wg.Wait()
				b.StopTimer()
				if s := sent.Load(); s > 0 {
					b.ReportMetric(100*float64(lost.Load())/float64(s), "loss%")
				}
			})
		}
	}
}

// windowLoad gets n datagrams answered on c with up to window in flight and
// returns how many it sent and how many it gave up on.
func windowLoad(c *net.UDPConn, n, window int) (sent, lost int) {
	msg, buf := make([]byte, 512), make([]byte, 2048)
	inflight := 0
	fill := func() {
		for inflight < window && sent-lost < n {
			c.Write(msg)
			sent++
			inflight++
		}
	}
	fill()
	for got := 0; got < n; {
		if got%256 == 0 {
			c.SetReadDeadline(time.Now().Add(time.Second))
		}
		if _, err := c.Read(buf); err != nil {
			lost += inflight // everything in flight is presumed gone
			inflight = 0
			c.SetReadDeadline(time.Now().Add(time.Second))
			fill()
			continue
		}
		got++
		inflight--
		fill()
	}
	return sent, lost
}

// udpEchoGuest answers every datagram with itself, allocating nothing.
func udpEchoGuest(tb testing.TB) uint16 {
	pc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(loopback, 0)))
	require.NoError(tb, err)
	tb.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, maxDatagram)
		for {
			n, from, err := pc.ReadFromUDPAddrPort(buf)
			if err != nil {
				return
			}
			pc.WriteToUDPAddrPort(buf[:n], from)
		}
	}()
	return pc.LocalAddr().(*net.UDPAddr).AddrPort().Port()
}

// BenchmarkIdleExposures reports what 1,000 bound, idle exposures cost
// (half TCP, half UDP).
func BenchmarkIdleExposures(b *testing.B) {
	for range b.N {
		heap, rss := idleExposureCost(b, 1000)
		b.ReportMetric(float64(heap)/(1<<20), "heapMiB/1000")
		b.ReportMetric(float64(rss)/(1<<20), "rssMiB/1000")
	}
}

// TestIdleExposuresAreCheap: the memory goal for a host with many published
// ports — 1,000 idle exposures well under 50 MiB.
func TestIdleExposuresAreCheap(t *testing.T) {
	heap, rss := idleExposureCost(t, 1000)
	t.Logf("1000 idle exposures: heap+stacks %.1f MiB, RSS %.1f MiB", float64(heap)/(1<<20), float64(rss)/(1<<20))
	require.Less(t, heap, uint64(50<<20))
}

// idleExposureCost binds n exposures and returns the growth in Go heap plus
// goroutine stacks, and in process RSS (coarser: includes kernel-visible
// runtime overhead, 0 if unreadable).
func idleExposureCost(tb testing.TB, n int) (heapStack, rss uint64) {
	measure := func() (uint64, uint64) {
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return ms.HeapInuse + ms.StackInuse, readRSS()
	}
	h0, r0 := measure()
	p := New(Config{Resolve: newGuests().resolve})
	specs := make([]Spec, n)
	for i := range specs {
		specs[i] = tcpSpec(fmt.Sprintf("e%d", i), "vm1", 80)
		if i%2 == 1 {
			specs[i].Protocol = UDP
		}
	}
	for _, st := range p.Converge(specs) {
		require.Equal(tb, StateActive, st.State, st.Reason)
	}
	h1, r1 := measure()
	p.Close()
	if r1 < r0 {
		r1 = r0
	}
	return h1 - min(h0, h1), r1 - r0
}

func readRSS() uint64 {
	raw, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "VmRSS:" {
			kb, _ := strconv.ParseUint(f[1], 10, 64)
			return kb << 10
		}
	}
	return 0
}
