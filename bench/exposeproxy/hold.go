package main

import (
	"bufio"
	"context"
	"errors"
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
	"syscall"
	"time"

	"github.com/a73x/eitri/agent/exposeproxy"
)

// raiseNoFile lifts this process's descriptor limit as far as the system
// allows: a forwarder holding 20,000 connections needs several descriptors
// for each.
func raiseNoFile() error {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return err
	}
	want := lim
	if raw, err := os.ReadFile("/proc/sys/fs/nr_open"); err == nil {
		if n, err := strconv.ParseUint(strings.TrimSpace(string(raw)), 10, 64); err == nil && n > want.Max {
			want.Max = n
		}
	}
	want.Cur = want.Max
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &want); err != nil {
		lim.Cur = lim.Max // not privileged: the soft limit up to the hard one
		return syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	return nil
}

// serveStats answers each connection with one line of the proxy process's own
// counts, inline so that asking adds no goroutine. A connection that first
// sends "gc" gets them after two collections and a moment for finalizers:
// Go caches splice pipes in a pool that only a collection empties, so
// descriptors settle back to the baseline only after one.
func serveStats(ln net.Listener, p *exposeproxy.Proxy) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if req, _ := bufio.NewReader(c).ReadString('\n'); strings.TrimSpace(req) == "gc" {
			runtime.GC()
			runtime.GC()
			time.Sleep(100 * time.Millisecond)
		}
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		var active, refused, dropped int64
		for _, st := range p.Status() {
			active, refused, dropped = active+st.Active, refused+st.Refused, dropped+st.Dropped
		}
		fmt.Fprintf(c, "goroutines=%d heap_stack=%d active=%d refused=%d dropped=%d\n",
			runtime.NumGoroutine(), ms.HeapInuse+ms.StackInuse, active, refused, dropped)
		c.Close()
	}
}

type holdConfig struct {
	to      string // the published port (or any forwarder) in front of an echo
	stats   string // the proxy's serveStats address; "" for a forwarder without one
	pid     int    // the forwarder's process
	held    int
	rate    int
	dur     time.Duration
	sources int
}

// snapshot is what the forwarder process looks like at one moment.
type snapshot struct {
	fds, threads int
	rssKB        int64
	stats        map[string]int64 // from serveStats, when there is one
}

func (c holdConfig) snap() (snapshot, error) { return c.snapAfter("") }

// snapAfter takes a snapshot; req "gc" has the proxy collect garbage first.
func (c holdConfig) snapAfter(req string) (snapshot, error) {
	var s snapshot
	if req != "" && c.stats != "" {
		// Ask before counting, so the collection's effect is what is counted.
		conn, err := net.Dial("tcp", c.stats)
		if err != nil {
			return s, err
		}
		fmt.Fprintln(conn, req)
		io.Copy(io.Discard, conn)
		conn.Close()
	}
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", c.pid))
	if err != nil {
		return s, err
	}
	s.fds = len(ents)
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", c.pid))
	if err != nil {
		return s, err
	}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		switch f[0] {
		case "VmRSS:":
			s.rssKB, _ = strconv.ParseInt(f[1], 10, 64)
		case "Threads:":
			s.threads, _ = strconv.Atoi(f[1])
		}
	}
	if c.stats == "" {
		return s, nil
	}
	conn, err := net.Dial("tcp", c.stats)
	if err != nil {
		return s, err
	}
	defer conn.Close()
	fmt.Fprintln(conn)
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return s, err
	}
	s.stats = map[string]int64{}
	for _, kv := range strings.Fields(line) {
		k, v, _ := strings.Cut(kv, "=")
		s.stats[k], _ = strconv.ParseInt(v, 10, 64)
	}
	return s, nil
}

func (s snapshot) String() string {
	out := fmt.Sprintf("fds=%d threads=%d rss_kb=%d", s.fds, s.threads, s.rssKB)
	for _, k := range []string{"goroutines", "heap_stack", "active", "refused", "dropped"} {
		if v, ok := s.stats[k]; ok {
			out += fmt.Sprintf(" %s=%d", k, v)
		}
	}
	return out
}

// dialers spread connections over several loopback source addresses so the
// client side never runs short of ephemeral ports.
type dialers struct {
	ds   []net.Dialer
	next atomic.Uint64
}

func newDialers(n int) *dialers {
	d := &dialers{}
	for i := range n {
		src := netip.AddrFrom4([4]byte{127, 0, byte((2 + i) >> 8), byte(2 + i)})
		d.ds = append(d.ds, net.Dialer{Timeout: 10 * time.Second,
			LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))})
	}
	return d
}

// ping opens a connection and proves it reaches the echo behind the
// forwarder: a forwarder that accepts and then closes (a refusal at its cap,
// a failed dial to the guest) shows up as an error here.
func (d *dialers) ping(to string) (net.Conn, *stageError) {
	dl := &d.ds[d.next.Add(1)%uint64(len(d.ds))]
	c, err := dl.Dial("tcp", to)
	if err != nil {
		return nil, &stageError{"dial", err}
	}
	if err := roundTrip(c); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func roundTrip(c net.Conn) *stageError {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write([]byte{'x'}); err != nil {
		return &stageError{"write", err}
	}
	one := make([]byte, 1)
	if _, err := io.ReadFull(c, one); err != nil {
		return &stageError{"no echo", err}
	}
	return nil
}

// stageError is a failed connection and the step it failed at.
type stageError struct {
	stage string
	err   error
}

// failures counts errors by step and root cause (addresses left out, so
// thousands of failures read as a few lines).
type failures struct {
	mu sync.Mutex
	m  map[string]int
	n  atomic.Int64
}

func (f *failures) add(e *stageError) {
	f.n.Add(1)
	root := e.err
	for u := errors.Unwrap(root); u != nil; u = errors.Unwrap(root) {
		root = u
	}
	f.mu.Lock()
	if f.m == nil {
		f.m = map[string]int{}
	}
	f.m[e.stage+": "+root.Error()]++
	f.mu.Unlock()
}

func (f *failures) String() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return fmt.Sprint(f.m)
}

// hold opens c.held connections through the forwarder and keeps them, opens
// and closes c.rate more a second for c.dur beside them, checks every held
// connection still answers, closes them all and waits for the forwarder's
// descriptors and goroutines to return to where they started.
func hold(ctx context.Context, c holdConfig) error {
	if c.pid == 0 {
		return errors.New("hold needs -pid of the forwarder")
	}
	d := newDialers(c.sources)
	base, err := c.snap()
	if err != nil {
		return err
	}
	fmt.Printf("baseline: %s\n", base)

	// Open the held connections, 64 at a time.
	start := time.Now()
	conns := make([]net.Conn, c.held)
	var openFail failures
	var wg sync.WaitGroup
	var next atomic.Int64
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= c.held || ctx.Err() != nil {
					return
				}
				conn, err := d.ping(c.to)
				if err != nil {
					openFail.add(err)
					continue
				}
				conns[i] = conn
			}
		}()
	}
	wg.Wait()
	fmt.Printf("opened %d held connections in %.1fs, %d failed %s\n",
		int64(c.held)-openFail.n.Load(), time.Since(start).Seconds(), openFail.n.Load(), &openFail)
	heldSnap, err := c.snap()
	if err != nil {
		return err
	}
	fmt.Printf("holding: %s\n", heldSnap)

	// Churn beside them: c.rate short connections a second, each proven
	// end to end, started on a fixed schedule whether or not earlier ones
	// have finished (up to 4 seconds' worth in flight).
	var churnOK atomic.Int64
	var churnFail failures
	var late atomic.Int64
	slots := make(chan struct{}, 4*c.rate)
	t := time.NewTicker(10 * time.Millisecond)
	churnStart := time.Now()
	var peak snapshot
	var lastSnap time.Time
	begun := 0
	for time.Since(churnStart) < c.dur && ctx.Err() == nil {
		<-t.C
		// Catch up on the schedule: a late tick starts what was due.
		due := int(time.Since(churnStart).Seconds()*float64(c.rate)) - begun
		for range due {
			begun++
			select {
			case slots <- struct{}{}:
			default:
				late.Add(1)
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-slots }()
				conn, err := d.ping(c.to)
				if err != nil {
					churnFail.add(err)
					return
				}
				conn.Close()
				churnOK.Add(1)
			}()
		}
		if time.Since(lastSnap) > 5*time.Second {
			if s, err := c.snap(); err == nil && s.fds > peak.fds {
				peak = s
			}
			lastSnap = time.Now()
		}
	}
	t.Stop()
	wg.Wait()
	churnSecs := time.Since(churnStart).Seconds()
	fmt.Printf("churn: %d ok in %.1fs (%.0f/s), %d failed %s, %d not started (client behind)\n",
		churnOK.Load(), churnSecs, float64(churnOK.Load())/churnSecs, churnFail.n.Load(), &churnFail, late.Load())
	fmt.Printf("peak during churn: %s\n", peak)

	// Every held connection must have survived the churn.
	alive, dead := 0, 0
	for _, conn := range conns {
		if conn == nil {
			continue
		}
		if roundTrip(conn) == nil {
			alive++
		} else {
			dead++
		}
	}
	after, err := c.snap()
	if err != nil {
		return err
	}
	fmt.Printf("held connections still answering: %d, lost: %d\n", alive, dead)
	fmt.Printf("after churn: %s\n", after)

	n := int64(alive + dead)
	if n > 0 {
		fmt.Printf("memory per held connection: rss %.1f KiB", float64(heldSnap.rssKB-base.rssKB)/float64(n))
		if hs, ok := heldSnap.stats["heap_stack"]; ok {
			fmt.Printf(", go heap+stacks %.1f KiB", float64(hs-base.stats["heap_stack"])/1024/float64(n))
		}
		fmt.Printf("; descriptors %.2f each\n", float64(heldSnap.fds-base.fds)/float64(n))
	}

	for _, conn := range conns {
		if conn != nil {
			conn.Close()
		}
	}
	closed := time.Now()
	var end snapshot
	for {
		if end, err = c.snap(); err != nil {
			return err
		}
		settled := end.fds <= base.fds
		if g, ok := end.stats["goroutines"]; ok {
			// Descriptors may wait for a collection (see serveStats).
			settled = g <= base.stats["goroutines"] && end.stats["active"] == 0
		}
		if settled || time.Since(closed) > time.Minute {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	fmt.Printf("closed all, after %.1fs: %s\n", time.Since(closed).Seconds(), end)
	fmt.Printf("descriptors %d -> %d", base.fds, end.fds)
	if g, ok := end.stats["goroutines"]; ok {
		fmt.Printf(", goroutines %d -> %d", base.stats["goroutines"], g)
		gcd, err := c.snapAfter("gc")
		if err != nil {
			return err
		}
		fmt.Printf("; after a collection: descriptors %d, goroutines %d, heap+stacks %d KiB",
			gcd.fds, gcd.stats["goroutines"], gcd.stats["heap_stack"]>>10)
	}
	fmt.Println()
	return nil
}
