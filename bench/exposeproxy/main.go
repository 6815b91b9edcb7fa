// Command exposeproxy-bench is the load side of compare.sh: guests (sinks and
// echoes), the proxy under test, and load generators that print one line of
// key=value results. Loopback only.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/a73x/eitri/agent/exposeproxy"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: exposeproxy-bench proxy|sink|echo|udpecho|tcpsend|connrate|udpload|idle|hold ...")
		os.Exit(2)
	}
	cmd, args := os.Args[1], os.Args[2:]
	fs := flag.NewFlagSet(cmd, flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:0", "address to listen on")
	to := fs.String("to", "", "address to send to")
	proto := fs.String("proto", "tcp", "tcp or udp (proxy)")
	streams := fs.Int("streams", 1, "parallel streams / workers")
	dur := fs.Duration("dur", 3*time.Second, "test duration")
	size := fs.Int("size", 512, "datagram size")
	window := fs.Int("window", 32, "datagrams in flight per UDP client")
	n := fs.Int("n", 1000, "idle exposures")
	maxConns := fs.Int("cap", 1<<16, "the exposure's connection/session cap (proxy)")
	stats := fs.String("stats", "", "address to report the proxy's own counts on (proxy); the target's (hold)")
	pid := fs.Int("pid", 0, "forwarder process whose descriptors and memory to watch (hold)")
	held := fs.Int("held", 20000, "connections to hold (hold)")
	rate := fs.Int("rate", 1000, "new connections per second while holding (hold)")
	sources := fs.Int("sources", 16, "client source addresses 127.0.0.2... (hold)")
	fs.Parse(args)
	if err := raiseNoFile(); err != nil {
		fmt.Fprintln(os.Stderr, "raise RLIMIT_NOFILE:", err)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	switch cmd {
	case "proxy":
		err = runProxy(ctx, *proto, *listen, *to, *maxConns, *stats)
	case "sink":
		err = serveTCP(ctx, *listen, func(c *net.TCPConn) { io.Copy(io.Discard, c); c.Write([]byte{1}) })
	case "echo":
		err = serveTCP(ctx, *listen, echoTCP)
	case "udpecho":
		err = udpEcho(ctx, *listen)
	case "tcpsend":
		err = tcpSend(*to, *streams, *dur)
	case "connrate":
		err = connRate(*to, *streams, *dur)
	case "udpload":
		err = udpLoad(*to, *streams, *window, *size, *dur)
	case "idle":
		err = idle(ctx, *n)
	case "hold":
		err = hold(ctx, holdConfig{to: *to, stats: *stats, pid: *pid, held: *held, rate: *rate,
			dur: *dur, sources: *sources})
	default:
		err = fmt.Errorf("unknown command %q", cmd)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

// runProxy forwards one exposure until signalled; the guest is "to".
func runProxy(ctx context.Context, proto, listen, to string, maxConns int, stats string) error {
	guest, err := netip.ParseAddrPort(to)
	if err != nil {
		return err
	}
	l, err := netip.ParseAddrPort(listen)
	if err != nil {
		return err
	}
	p := exposeproxy.New(exposeproxy.Config{
		Log:         slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Resolve:     func(string) (netip.Addr, bool) { return guest.Addr(), true },
		MaxConns:    maxConns,
		MaxSessions: maxConns,
	})
	defer p.Close()
	st := p.Converge([]exposeproxy.Spec{{ID: "bench", VMID: "vm", Protocol: exposeproxy.Protocol(proto), Listen: l, GuestPort: guest.Port()}})
	if st[0].State != exposeproxy.StateActive {
		return fmt.Errorf("bind: %s", st[0].Reason)
	}
	if stats != "" {
		ln, err := net.Listen("tcp", stats)
		if err != nil {
			return err
		}
		defer ln.Close()
		go serveStats(ln, p)
	}
	<-ctx.Done()
	fmt.Fprintf(os.Stderr, "proxy counters: active=%d refused=%d dropped=%d\n", p.Status()[0].Active, p.Status()[0].Refused, p.Status()[0].Dropped)
	return nil
}

func serveTCP(ctx context.Context, listen string, handle func(*net.TCPConn)) error {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); ln.Close() }()
	for {
		c, err := ln.(*net.TCPListener).AcceptTCP()
		if err != nil {
			return nil
		}
		go func() { defer c.Close(); handle(c) }()
	}
}

// echoTCP answers until EOF with a plain read/write loop: io.Copy would
// splice and keep a pipe (two descriptors) per idle connection, and the echo
// behind hold.sh holds 20,000 of them.
func echoTCP(c *net.TCPConn) {
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			c.CloseWrite()
			return
		}
	}
}

func udpEcho(ctx context.Context, listen string) error {
	pc, err := net.ListenPacket("udp", listen)
	if err != nil {
		return err
	}
	go func() { <-ctx.Done(); pc.Close() }()
	buf := make([]byte, 65536)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return nil
		}
		pc.WriteTo(buf[:n], from)
	}
}

// tcpSend pushes bytes over parallel streams for dur and reports goodput the
// sink confirmed, as a rate and as a byte count.
func tcpSend(to string, streams int, dur time.Duration) error {
	var total atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, streams)
	start := time.Now()
	for range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.Dial("tcp", to)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close()
			buf := make([]byte, 128<<10)
			var sent int64
			for time.Since(start) < dur {
				n, err := c.Write(buf)
				sent += int64(n)
				if err != nil {
					errs <- err
					return
				}
			}
			c.(*net.TCPConn).CloseWrite()
			if _, err := io.ReadFull(c, make([]byte, 1)); err != nil {
				errs <- fmt.Errorf("sink did not confirm: %w", err)
				return
			}
			total.Add(sent)
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return err
	}
	secs := time.Since(start).Seconds()
	// bytes lets compare.sh turn the proxy's CPU time into seconds per GB.
	fmt.Printf("mbps=%.0f bytes=%d\n", float64(total.Load())*8/secs/1e6, total.Load())
	return nil
}

// connRate opens short connections (one byte each way) from parallel workers.
func connRate(to string, workers int, dur time.Duration) error {
	var done, failed atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			one := make([]byte, 1)
			for time.Since(start) < dur {
				c, err := net.DialTimeout("tcp", to, 2*time.Second)
				if err != nil {
					failed.Add(1)
					continue
				}
				c.SetDeadline(time.Now().Add(2 * time.Second))
				c.Write(one)
				_, err = io.ReadFull(c, one)
				c.Close()
				if err != nil {
					failed.Add(1)
					continue
				}
				done.Add(1)
			}
		}()
	}
	wg.Wait()
	fmt.Printf("cps=%.0f failed=%d\n", float64(done.Load())/time.Since(start).Seconds(), failed.Load())
	return nil
}

// udpLoad runs clients that each keep window datagrams in flight against an
// echo; a datagram not answered within a second is lost and its slot refilled.
// Reports answered datagrams per second and the lost fraction.
func udpLoad(to string, clients, window, size int, dur time.Duration) error {
	var sent, recv atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c, err := net.Dial("udp", to)
			if err != nil {
				return
			}
			defer c.Close()
			msg, buf := make([]byte, size), make([]byte, 65536)
			for range window {
				c.Write(msg)
				sent.Add(1)
			}
			for time.Since(start) < dur {
				c.SetReadDeadline(time.Now().Add(time.Second))
				if _, err := c.Read(buf); err != nil {
					// Everything in flight is presumed lost; refill the window.
					for range window {
						c.Write(msg)
						sent.Add(1)
					}
					continue
				}
				recv.Add(1)
				c.Write(msg)
				sent.Add(1)
			}
			// Drain late answers so in-flight datagrams are not counted lost.
			for {
				c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
				if _, err := c.Read(buf); err != nil {
					return
				}
				recv.Add(1)
			}
		}()
	}
	wg.Wait()
	s, r := sent.Load(), recv.Load()
	loss := 0.0
	if s > 0 {
		loss = 100 * float64(s-r) / float64(s)
	}
	fmt.Printf("pps=%.0f loss_pct=%.3f\n", float64(r)/dur.Seconds(), loss)
	return nil
}

// idle holds n idle exposures (half TCP, half UDP) and reports its own RSS
// once they are bound, then waits to be killed (so compare.sh can read PSS).
func idle(ctx context.Context, n int) error {
	p := exposeproxy.New(exposeproxy.Config{
		Log:     slog.New(slog.NewTextHandler(io.Discard, nil)),
		Resolve: func(string) (netip.Addr, bool) { return netip.Addr{}, false },
	})
	defer p.Close()
	specs := make([]exposeproxy.Spec, n)
	for i := range specs {
		proto := exposeproxy.TCP
		if i%2 == 1 {
			proto = exposeproxy.UDP
		}
		specs[i] = exposeproxy.Spec{ID: fmt.Sprint(i), VMID: "vm", Protocol: proto,
			Listen: netip.MustParseAddrPort("127.0.0.1:0"), GuestPort: 80}
	}
	for _, st := range p.Converge(specs) {
		if st.State != exposeproxy.StateActive {
			return fmt.Errorf("exposure %s: %s", st.ID, st.Reason)
		}
	}
	fmt.Println("ready")
	<-ctx.Done()
	return nil
}
