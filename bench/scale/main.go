// Command scale measures how a real control plane carries what hosts say to
// the consoles watching (issue 13): it starts `eitri server` (TLS, its own
// data dir), enrolls N simulated agents with join tokens, each of which
// runs the real Sync stream (agent/syncclient) and reports its VMs, then
// opens M watchers — WatchVMs and WatchExposures, over the Connect protocol
// and gRPC, each on its own connection as consoles are. Every agent sends a
// complete report each -every in which one VM narrates ("downloading image
// …") and one exposure's session counter moves. It prints:
//
//   - reports/s absorbed (changed reports the agents got out; Sync is flow
//     controlled, so a control plane that falls behind slows this down),
//
//   - report→watcher latency p50/p99/max over every delivery,
//
//   - the share of (watcher, object) pairs whose latest state arrived
//     (intermediate values may be coalesced, the latest never),
//
//   - control-plane CPU (cores) and RSS from /proc, and the bytes it
//     allocated per delivered change (from its GODEBUG=gctrace=1 lines:
//     the server has no debug endpoint and needs none for this),
//
//   - how long each process's threads were runnable but waiting for a CPU
//     (schedstat): on a shared machine, queueing that no profile shows,
//
//   - then (-floor) the same block for a floor peer: this binary again as
//     a bare net/http HTTP/2 + TLS server with eitri's pacing, fed the same
//     narration and watched by the same watchers — what any server on this
//     stack pays (floor.go),
//
//   - and, in the same run, a plain in-process channel fan-out of the same
//     change rate to the same number of receivers: the floor without a
//     network.
//
//     make build && go run ./bench/scale -hosts 200 -vms 20 -watchers 1000
//     make bench-scale
package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sync/errgroup"

	"github.com/a73x/eitri/agent/syncclient"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

type config struct {
	bin                  string
	hosts, vms, watchers int
	every, dur, drain    time.Duration
	verbose, floor       bool
}

func main() {
	var c config
	flag.StringVar(&c.bin, "bin", envOr("EITRI_BIN", "bin/eitri"), "the eitri binary to run as the control plane")
	flag.IntVar(&c.hosts, "hosts", 200, "simulated agents")
	flag.IntVar(&c.vms, "vms", 20, "VMs per host")
	flag.IntVar(&c.watchers, "watchers", 1000, "watch streams (a quarter each: WatchVMs Connect/gRPC, WatchExposures Connect/gRPC)")
	flag.DurationVar(&c.every, "every", 2*time.Second, "how often each agent's narration moves (one changed report)")
	flag.DurationVar(&c.dur, "for", 20*time.Second, "how long to measure")
	flag.DurationVar(&c.drain, "drain", 10*time.Second, "how long after the last change to wait for the latest state to arrive")
	flag.BoolVar(&c.verbose, "v", false, "show the server's output")
	flag.BoolVar(&c.floor, "floor", true, "then measure the floor server (bare net/http HTTP/2 + TLS, same pacing) with the same load and watchers")
	serve := flag.Bool("serve-floor", false, "(internal) be the floor server: the child process -floor starts")
	flag.Parse()
	if *serve {
		if err := serveFloor(); err != nil {
			slog.Error("floor server", "err", err)
			os.Exit(1)
		}
		return
	}
	if err := run(context.Background(), c); err != nil {
		slog.Error("scale bench", "err", err)
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func run(ctx context.Context, c config) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	dir, err := os.MkdirTemp("", "eitri-scale-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	echo := io.Discard
	if c.verbose {
		echo = os.Stderr
	}
	srv, err := start(ctx, c.bin, dir, echo)
	if err != nil {
		return err
	}
	defer srv.stop()

	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, ForceAttemptHTTP2: true}}
	auth := connect.WithInterceptors(connclient.Bearer(srv.token))
	hostsAPI := eitriv1connect.NewHostServiceClient(hc, srv.url, auth)
	quotaAPI := eitriv1connect.NewQuotaServiceClient(hc, srv.url, auth)
	big := int64(1 << 40)
	if _, err := quotaAPI.SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{Limits: &eitriv1.QuotaLimits{
		Vms: &big, Vcpus: &big, MemMb: &big, DiskGb: &big, Exposures: &big, Streams: &big,
	}})); err != nil {
		return fmt.Errorf("raise the admin's quota: %w", err)
	}

	// Enroll the hosts and start their streams.
	t0 := time.Now()
	tr := newTracks()
	var reports atomic.Int64
	hosts := make([]*simHost, c.hosts)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var g errgroup.Group
	g.SetLimit(8)
	for i := range hosts {
		g.Go(func() error {
			jt, err := hostsAPI.CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
			if err != nil {
				return fmt.Errorf("join token: %w", err)
			}
			id, err := syncclient.Enroll(ctx, jt.Msg.GetToken(), fmt.Sprintf("sim-%04d", i), "scale-sim")
			if err != nil {
				return err
			}
			h := newSimHost(id.HostID, tr, &reports)
			hosts[i] = h
			go func() {
				_ = syncclient.Run(ctx, syncclient.Config{
					Identity: id, Source: h, Log: quiet, ReportEvery: time.Second, Heartbeat: 10 * time.Second,
					Hello: func() *eitriv1.Hello {
						return &eitriv1.Hello{HostId: id.HostID, AgentVersion: "scale-sim", Hostname: fmt.Sprintf("sim-%04d", i),
							Address: "127.0.0.1", Accelerator: "tcg", InstanceId: id.HostID}
					},
				})
			}()
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "enrolled %d hosts in %s\n", c.hosts, time.Since(t0).Round(time.Millisecond))

	// Their VMs and one exposure each, through the API as people make them:
	// each host's VMs belong to a user of their own (a team), so quota
	// checks stay per user and the admins' watchers see many owners.
	t0 = time.Now()
	tokensAPI := eitriv1connect.NewTokenServiceClient(hc, srv.url, auth)
	for i, h := range hosts {
		g.Go(func() error {
			user := fmt.Sprintf("team-%04d", i)
			tok, err := tokensAPI.CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "scale", UserName: user}))
			if err != nil {
				return fmt.Errorf("create token: %w", err)
			}
			if _, err := quotaAPI.SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{UserName: user, Limits: &eitriv1.QuotaLimits{
				Vms: &big, Vcpus: &big, MemMb: &big, DiskGb: &big, Exposures: &big,
			}})); err != nil {
				return fmt.Errorf("raise %s's quota: %w", user, err)
			}
			as := connect.WithInterceptors(connclient.Bearer(tok.Msg.GetSecret()))
			vmsAPI := eitriv1connect.NewVMServiceClient(hc, srv.url, as)
			expAPI := eitriv1connect.NewExposureServiceClient(hc, srv.url, as)
			var first string
			for j := range c.vms {
				req := &eitriv1.CreateVMRequest{Name: fmt.Sprintf("h%04d-v%02d", i, j), HostId: h.id,
					ImageUrl: "http://127.0.0.1:9/guest.raw", ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
					Vcpus: 1, MemMb: 64, DiskGb: 1}
				for {
					r, err := vmsAPI.CreateVM(ctx, connect.NewRequest(req))
					if connect.CodeOf(err) == connect.CodeFailedPrecondition { // not connected / no capacity yet
						time.Sleep(100 * time.Millisecond)
						continue
					}
					if err != nil {
						return fmt.Errorf("create vm: %w", err)
					}
					if first == "" {
						first = r.Msg.GetVm().GetId()
					}
					break
				}
			}
			_, err = expAPI.CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{VmId: first, GuestPort: 22, Protocol: "tcp"}))
			if err != nil {
				return fmt.Errorf("create exposure: %w", err)
			}
			return nil
		})
	}
	if err := g.Wait(); err != nil {
		return err
	}
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		n := 0
		for _, h := range hosts {
			if h.ready(c.vms, 1) {
				n++
			}
		}
		if n == len(hosts) {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d hosts got their VMs in a snapshot", n, len(hosts))
		}
	}
	fmt.Fprintf(os.Stderr, "created %d VMs and %d exposures in %s\n", c.hosts*c.vms, c.hosts, time.Since(t0).Round(time.Millisecond))

	steps := make([]func(), len(hosts))
	for i, h := range hosts {
		steps[i] = h.step
	}
	rate, err := measure(ctx, c, target{title: "control plane", who: "control-plane", srv: srv, url: srv.url, token: srv.token,
		tr: tr, steps: steps, reports: &reports})
	if err != nil {
		return err
	}

	// The floor and the baseline get the machine to themselves.
	srv.stop()
	cancel() // the agents
	if c.floor {
		if err := floor(context.Background(), c, echo); err != nil {
			return fmt.Errorf("floor: %w", err)
		}
	}
	b := baseline(c.watchers, rate, min(c.dur, 5*time.Second))
	fmt.Printf("baseline (in-process channel fan-out, same rate, same receivers): p50=%s p99=%s max=%s, %.2f µs CPU and %.2f allocs per delivery\n",
		b.p50, b.p99, b.max, b.cpuPerDelivery, b.allocsPerDelivery)
	return nil
}

// target is a server under measurement and what feeds it: one step per
// simulated host (its next narration beat), the tracks those changes are
// stamped in, and a count of the changed reports that left.
type target struct {
	title      string // the block's heading
	who        string // the server in the block's lines ("control-plane")
	srv        *server
	url, token string
	tr         *tracks
	steps      []func()
	reports    *atomic.Int64
}

// measure opens the watchers on t, narrates for c.dur, waits for the
// latest state to arrive and prints the block. It returns the changed
// reports per second it absorbed.
func measure(ctx context.Context, c config, t target) (float64, error) {
	srv, tr, reports := t.srv, t.tr, t.reports
	// The watchers.
	t0 := time.Now()
	ws := make([]*watcher, c.watchers)
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	var wwg sync.WaitGroup
	for i := range ws {
		w := &watcher{kind: "vms", grpc: i%2 == 1, seen: map[string]uint64{}, connected: make(chan struct{})}
		if i%4 >= 2 {
			w.kind = "exposures"
		}
		ws[i] = w
		wwg.Go(func() { w.run(wctx, t.url, t.token, tr) })
		if i%50 == 49 {
			<-w.connected // don't open a thousand TLS handshakes at once
		}
	}
	for _, w := range ws {
		<-w.connected
		if w.err != nil {
			return 0, fmt.Errorf("watcher (%s, grpc=%v): %w", w.kind, w.grpc, w.err)
		}
	}
	fmt.Fprintf(os.Stderr, "opened %d watchers in %s\n", c.watchers, time.Since(t0).Round(time.Millisecond))

	// Narrate: each host steps every c.every, phases spread evenly.
	nctx, ncancel := context.WithCancel(ctx)
	var nwg sync.WaitGroup
	for _, step := range t.steps {
		nwg.Go(func() {
			select {
			case <-nctx.Done():
				return
			case <-time.After(rand.N(c.every)):
			}
			tick := time.NewTicker(c.every)
			defer tick.Stop()
			for {
				step()
				select {
				case <-nctx.Done():
					return
				case <-tick.C:
				}
			}
		})
	}

	cpu0, _, _ := srv.usage()
	self0 := selfCPU()
	wait0, selfWait0 := runWait(srv.cmd.Process.Pid), runWait(os.Getpid())
	writes0 := writeCalls(srv.cmd.Process.Pid)
	r0 := reports.Load()
	from := time.Now()
	time.Sleep(c.dur)
	ncancel()
	nwg.Wait()
	to := time.Now()
	cpu1, rss, _ := srv.usage()
	self1 := selfCPU()
	wait1, selfWait1 := runWait(srv.cmd.Process.Pid), runWait(os.Getpid())
	writes1 := writeCalls(srv.cmd.Process.Pid)
	r1 := reports.Load()
	window := to.Sub(from)

	// Drain: wait for every watcher to hold every object's latest state.
	objs := func(kind string) map[string]uint64 {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		out := map[string]uint64{}
		for o, s := range tr.latest {
			if tr.kind[o] == kind {
				out[o] = s
			}
		}
		return out
	}
	// Let the last reports leave the agents (they are sent at once, or
	// at their next tick).
	time.Sleep(1500 * time.Millisecond)
	want := map[string]map[string]uint64{"vms": objs("vms"), "exposures": objs("exposures")}
	var pairs, got int
	deadline := time.Now().Add(c.drain)
	for {
		pairs, got = 0, 0
		for _, w := range ws {
			w.mu.Lock()
			for o, s := range want[w.kind] {
				pairs++
				if w.seen[o] >= s {
					got++
				}
			}
			w.mu.Unlock()
		}
		if got == pairs || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	allocMB, gcs := srv.allocated(from, to)
	wcancel()
	wwg.Wait()

	var lat []time.Duration
	var errs []error
	var deliveries int64
	for _, w := range ws {
		lat = append(lat, w.lat...)
		deliveries += w.msgs
		if w.err != nil {
			errs = append(errs, w.err)
		}
	}
	slices.Sort(lat)
	changes := int64(0)
	tr.mu.Lock()
	for _, m := range tr.at {
		changes += int64(len(m))
	}
	tr.mu.Unlock()

	fmt.Printf("%s: hosts=%d vms/host=%d watchers=%d (vms/exposures × connect/grpc) window=%s load1=%s\n",
		t.title, c.hosts, c.vms, c.watchers, window.Round(time.Millisecond), loadavg())
	fmt.Printf("  reports/s absorbed      %.1f (changed reports; %d changes to %d objects)\n", float64(r1-r0)/window.Seconds(), changes, pairsObjs(want))
	fmt.Printf("  report→watcher          p50=%s p99=%s max=%s (%d deliveries of a new value)\n", pct(lat, 50), pct(lat, 99), pct(lat, 100), len(lat))
	fmt.Printf("  latest state delivered  %.2f%% (%d of %d watcher×object pairs, %s after the last change)\n", 100*float64(got)/float64(max(pairs, 1)), got, pairs, c.drain)
	fmt.Printf("  %-24s%.2f cores, RSS %d MiB\n", t.who+" CPU", (cpu1-cpu0).Seconds()/window.Seconds(), rss>>20)
	fmt.Printf("  %-24s%.1f KiB per delivered message (%d MiB over %d GCs; %d messages received by watchers)\n",
		t.who+" alloc", float64(allocMB<<10)/float64(max(deliveries, 1)), allocMB, gcs, deliveries)
	fmt.Printf("  CPU per delivery        %.1f µs (%s CPU / messages received by watchers)\n",
		float64((cpu1-cpu0).Microseconds())/float64(max(deliveries, 1)), t.who)
	if writes1 > writes0 {
		fmt.Printf("  writes                  %.0f/s, %.1f µs of %s CPU per write (write system calls, /proc/pid/io)\n",
			float64(writes1-writes0)/window.Seconds(), float64((cpu1-cpu0).Microseconds())/float64(writes1-writes0), t.who)
	}
	fmt.Printf("  simulator CPU           %.2f cores (its agents and watchers, on the same machine)\n", (self1-self0).Seconds()/window.Seconds())
	fmt.Printf("  waiting for a CPU       %s %.2f, simulator %.2f (thread-seconds runnable but not running, per second)\n",
		strings.ReplaceAll(t.who, "-", " "), (wait1-wait0).Seconds()/window.Seconds(), (selfWait1-selfWait0).Seconds()/window.Seconds())
	if len(errs) > 0 {
		fmt.Printf("  watcher errors          %d (first: %v)\n", len(errs), errs[0])
	}
	return float64(r1-r0) / window.Seconds(), nil
}

func pairsObjs(m map[string]map[string]uint64) int {
	n := 0
	for _, o := range m {
		n += len(o)
	}
	return n
}

func pct(s []time.Duration, p int) time.Duration {
	if len(s) == 0 {
		return 0
	}
	i := min(len(s)-1, len(s)*p/100)
	return s[i].Round(10 * time.Microsecond)
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil || len(b) < 4 {
		return "?"
	}
	for i, c := range b {
		if c == ' ' {
			return string(b[:i])
		}
	}
	return "?"
}

type baselineResult struct {
	p50, p99, max                     time.Duration
	cpuPerDelivery, allocsPerDelivery float64
}

// baseline fans the same rate of changes out to n receivers over buffered
// channels in this process: what delivering a change costs with no network,
// no encoding and no store — the floor the control plane is compared with.
func baseline(n int, rate float64, dur time.Duration) baselineResult {
	type change struct {
		id string
		at time.Time
	}
	chans := make([]chan *change, n)
	lats := make([][]time.Duration, n)
	var wg sync.WaitGroup
	for i := range chans {
		chans[i] = make(chan *change, 1024)
		wg.Go(func() {
			for c := range chans[i] {
				lats[i] = append(lats[i], time.Since(c.at))
			}
		})
	}
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	cpu0 := selfCPU()
	every := time.Duration(float64(time.Second) / max(rate, 1))
	tick := time.NewTicker(every)
	end := time.Now().Add(dur)
	sent := 0
	for now := range tick.C {
		if now.After(end) {
			break
		}
		c := &change{id: "vm", at: time.Now()}
		for _, ch := range chans {
			ch <- c
		}
		sent++
	}
	tick.Stop()
	for _, ch := range chans {
		close(ch)
	}
	wg.Wait()
	cpu1 := selfCPU()
	runtime.ReadMemStats(&ms1)
	var all []time.Duration
	for _, l := range lats {
		all = append(all, l...)
	}
	slices.Sort(all)
	d := float64(max(len(all), 1))
	return baselineResult{
		p50: pct(all, 50), p99: pct(all, 99), max: pct(all, 100),
		cpuPerDelivery:    float64((cpu1 - cpu0).Microseconds()) / d,
		allocsPerDelivery: float64(ms1.Mallocs-ms0.Mallocs) / d,
	}
}

func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
