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
// With -replicas N -db postgres (issue 23) the control plane is N replicas
// of `eitri server` on one throwaway PostgreSQL (pgtest's, in a temp dir,
// as an unprivileged user): replica 1 starts first and makes the fleet's
// identity, the others take it from the database. Host i streams to
// replica i mod N only, its VMs are created through the next replica, and
// watcher i watches through replica i mod N. Each block then adds the
// latency and delivered share for watchers on a replica other than the
// agent's, each replica's CPU, PostgreSQL's CPU (all its processes), and
// the control plane's and database's CPU per change made. -compare first
// measures one replica on SQLite with the same load and prints both side
// by side.
//
//	make build && go run ./bench/scale -hosts 200 -vms 20 -watchers 1000
//	make bench-scale
//	make bench-scale-replicas
package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
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
	warmup               time.Duration
	verbose, floor       bool
	// replicas on db ("sqlite" or "postgres"); compare measures one
	// replica on SQLite first, with the same load.
	replicas int
	db       string
	compare  bool
	dbprobe  bool
	// cpuprofile: a path prefix; each replica writes its whole life's CPU
	// profile to PREFIX-<db>-<replicas>-<n>.pprof (EITRI_CPUPROFILE).
	cpuprofile string
	// benchfmt: a file the results are appended to in Go's benchmark
	// format, for benchstat (make bench-compare).
	benchfmt string
}

// multi: the run is about databases and replicas, so each block says what
// the replicas and their database cost and what crossed replicas.
func (c config) multi() bool { return c.compare || c.replicas > 1 || c.db != "sqlite" }

func main() {
	var c config
	flag.StringVar(&c.bin, "bin", envOr("EITRI_BIN", "bin/eitri"), "the eitri binary to run as the control plane")
	flag.IntVar(&c.hosts, "hosts", 200, "simulated agents")
	flag.IntVar(&c.vms, "vms", 20, "VMs per host")
	flag.IntVar(&c.watchers, "watchers", 1000, "watch streams (a quarter each: WatchVMs Connect/gRPC, WatchExposures Connect/gRPC)")
	flag.DurationVar(&c.every, "every", 2*time.Second, "how often each agent's narration moves (one changed report)")
	flag.DurationVar(&c.dur, "for", 20*time.Second, "how long to measure")
	flag.DurationVar(&c.warmup, "warmup", 20*time.Second, "how long the agents narrate before the window opens; changes sent before it are not measured")
	flag.DurationVar(&c.drain, "drain", 10*time.Second, "how long after the last change to wait for the latest state to arrive")
	flag.BoolVar(&c.verbose, "v", false, "show the server's output")
	flag.BoolVar(&c.floor, "floor", true, "then measure the floor server (bare net/http HTTP/2 + TLS, same pacing) with the same load and watchers")
	flag.IntVar(&c.replicas, "replicas", 1, "control-plane replicas sharing one database (more than one needs -db postgres); agents and watchers are spread over them")
	flag.StringVar(&c.db, "db", "sqlite", "the control plane's database: sqlite (in its data dir) or postgres (a throwaway cluster of Debian's PostgreSQL, fsync off)")
	flag.BoolVar(&c.compare, "compare", false, "first measure 1 replica on SQLite with the same load, then -replicas on -db, and print both side by side")
	flag.BoolVar(&c.dbprobe, "dbprobe", false, "with PostgreSQL, also time each change from its agent to the database (host_live, polled every 10 ms)")
	flag.StringVar(&c.cpuprofile, "cpuprofile", "", "path prefix: each replica writes a CPU profile of its whole run to PREFIX-<db>-<replicas>-<n>.pprof")
	flag.StringVar(&c.benchfmt, "benchfmt", "", "also append each control plane's results to this file in Go's benchmark format (for benchstat)")
	serve := flag.Bool("serve-floor", false, "(internal) be the floor server: the child process -floor starts")
	flag.Parse()
	switch {
	case c.db != "sqlite" && c.db != "postgres":
		fmt.Fprintf(os.Stderr, "-db %q: want sqlite or postgres\n", c.db)
		os.Exit(2)
	case c.replicas < 1:
		fmt.Fprintln(os.Stderr, "-replicas: at least 1")
		os.Exit(2)
	case c.replicas > 1 && c.db != "postgres":
		fmt.Fprintln(os.Stderr, "-replicas: several replicas share a PostgreSQL (-db postgres)")
		os.Exit(2)
	}
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

// variant is one control-plane configuration to measure: how many
// replicas, on which database.
type variant struct {
	db       string // "sqlite" or "postgres"
	replicas int
}

func (v variant) String() string {
	db := "SQLite"
	if v.db == "postgres" {
		db = "PostgreSQL"
	}
	if v.replicas == 1 {
		return "1 replica, " + db
	}
	return fmt.Sprintf("%d replicas, %s", v.replicas, db)
}

func run(ctx context.Context, c config) error {
	echo := io.Discard
	if c.verbose {
		echo = os.Stderr
	}
	vs := []variant{{c.db, c.replicas}}
	if c.compare {
		vs = append([]variant{{"sqlite", 1}}, vs...)
	}
	var results []result
	for _, v := range vs {
		r, err := runControlPlane(ctx, c, v, echo)
		if err != nil {
			return fmt.Errorf("%s: %w", v, err)
		}
		results = append(results, r)
	}
	if len(results) > 1 {
		compare(c, results)
	}

	// The floor and the baseline get the machine to themselves.
	if c.floor {
		if err := floor(context.Background(), c, echo); err != nil {
			return fmt.Errorf("floor: %w", err)
		}
	}
	b := baseline(c.watchers, results[0].rate, min(c.dur, 5*time.Second))
	fmt.Printf("baseline (in-process channel fan-out, same rate, same receivers): p50=%s p99=%s max=%s, %.2f µs CPU and %.2f allocs per delivery\n",
		b.p50, b.p99, b.max, b.cpuPerDelivery, b.allocsPerDelivery)
	return nil
}

// runControlPlane starts v — its database, then its replicas one after
// the other — enrolls the hosts, spread over the replicas, makes their VMs
// and measures. Everything it started is stopped when it returns.
func runControlPlane(ctx context.Context, c config, v variant, echo io.Writer) (result, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	dir, err := os.MkdirTemp("", "eitri-scale-")
	if err != nil {
		return result{}, err
	}
	defer os.RemoveAll(dir)
	var pg *postgres
	srvs := make([]*server, 0, v.replicas)
	// stop ends the agents, then the replicas, then their database.
	stop := sync.OnceFunc(func() {
		cancel()
		for _, s := range srvs {
			s.stop()
		}
		if pg != nil {
			pg.stop()
		}
	})
	defer stop()
	dsn := ""
	if v.db == "postgres" {
		t0 := time.Now()
		if pg, err = startPostgres(ctx); err != nil {
			return result{}, fmt.Errorf("start PostgreSQL: %w", err)
		}
		dsn = pg.dsn
		fmt.Fprintf(os.Stderr, "started PostgreSQL in %s in %s (%s)\n", pg.srv.Dir, time.Since(t0).Round(time.Millisecond), pg.settings(ctx))
	}
	// Replica 1 makes the fleet's identity (its CA and certificate, the
	// first admin) and keeps it in the database; the others, started once
	// it is up, take it. Each has its own data dir.
	urls := make([]string, v.replicas)
	for i := range v.replicas {
		rdir := filepath.Join(dir, fmt.Sprintf("replica-%d", i+1))
		if err := os.Mkdir(rdir, 0o700); err != nil {
			return result{}, err
		}
		profile := ""
		if c.cpuprofile != "" {
			profile = fmt.Sprintf("%s-%s-%d-%d.pprof", c.cpuprofile, v.db, v.replicas, i+1)
		}
		s, err := start(ctx, c.bin, rdir, dsn, profile, echo)
		if err != nil {
			return result{}, fmt.Errorf("replica %d: %w", i+1, err)
		}
		srvs = append(srvs, s)
		urls[i] = s.url
	}
	token := srvs[0].token
	if token == "" {
		return result{}, errors.New("replica 1 made no first admin (the database was not empty?)")
	}
	fp0, err := fingerprint(urls[0])
	if err != nil {
		return result{}, err
	}
	for i := 1; i < len(urls); i++ {
		fp, err := fingerprint(urls[i])
		if err != nil {
			return result{}, err
		}
		if fp != fp0 {
			return result{}, fmt.Errorf("replica %d presents certificate %s, replica 1 %s: agents pin one", i+1, fp, fp0)
		}
	}
	if v.replicas > 1 {
		fmt.Fprintf(os.Stderr, "%d replicas up, one certificate (%s…)\n", v.replicas, fp0[:16])
	}

	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, ForceAttemptHTTP2: true}}
	auth := connect.WithInterceptors(connclient.Bearer(token))
	hostsAPI := make([]eitriv1connect.HostServiceClient, len(urls))
	quotaAPI := make([]eitriv1connect.QuotaServiceClient, len(urls))
	tokensAPI := make([]eitriv1connect.TokenServiceClient, len(urls))
	for i, u := range urls {
		hostsAPI[i] = eitriv1connect.NewHostServiceClient(hc, u, auth)
		quotaAPI[i] = eitriv1connect.NewQuotaServiceClient(hc, u, auth)
		tokensAPI[i] = eitriv1connect.NewTokenServiceClient(hc, u, auth)
	}
	big := int64(1 << 40)
	if _, err := quotaAPI[0].SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{Limits: &eitriv1.QuotaLimits{
		Vms: &big, Vcpus: &big, MemMb: &big, DiskGb: &big, Exposures: &big, Streams: &big,
	}})); err != nil {
		return result{}, fmt.Errorf("raise the admin's quota: %w", err)
	}

	// Enroll the hosts and start their streams: host i enrolls through
	// and streams to replica i mod N (its home), and only to it.
	t0 := time.Now()
	tr := newTracks()
	var reports atomic.Int64
	hosts := make([]*simHost, c.hosts)
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	var g errgroup.Group
	g.SetLimit(8)
	for i := range hosts {
		home := i % len(urls)
		g.Go(func() error {
			jt, err := hostsAPI[home].CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
			if err != nil {
				return fmt.Errorf("join token: %w", err)
			}
			id, err := syncclient.Enroll(ctx, jt.Msg.GetToken(), fmt.Sprintf("sim-%04d", i), "scale-sim")
			if err != nil {
				return err
			}
			id.ServerURL, id.ServerURLs = urls[home], []string{urls[home]}
			h := newSimHost(id.HostID, home, tr, &reports)
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
		return result{}, err
	}
	fmt.Fprintf(os.Stderr, "enrolled %d hosts in %s\n", c.hosts, time.Since(t0).Round(time.Millisecond))

	// Their VMs and one exposure each, through the API as people make them:
	// each host's VMs belong to a user of their own (a team), so quota
	// checks stay per user and the admins' watchers see many owners. With
	// several replicas, through the replica after the host's home, so what
	// is asked reaches the agent across replicas.
	t0 = time.Now()
	for i, h := range hosts {
		via := (h.home + 1) % len(urls)
		g.Go(func() error {
			user := fmt.Sprintf("team-%04d", i)
			tok, err := tokensAPI[via].CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "scale", UserName: user}))
			if err != nil {
				return fmt.Errorf("create token: %w", err)
			}
			if _, err := quotaAPI[via].SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{UserName: user, Limits: &eitriv1.QuotaLimits{
				Vms: &big, Vcpus: &big, MemMb: &big, DiskGb: &big, Exposures: &big,
			}})); err != nil {
				return fmt.Errorf("raise %s's quota: %w", user, err)
			}
			as := connect.WithInterceptors(connclient.Bearer(tok.Msg.GetSecret()))
			vmsAPI := eitriv1connect.NewVMServiceClient(hc, urls[via], as)
			expAPI := eitriv1connect.NewExposureServiceClient(hc, urls[via], as)
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
		return result{}, err
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
			return result{}, fmt.Errorf("only %d of %d hosts got their VMs in a snapshot", n, len(hosts))
		}
	}
	created := time.Since(t0)
	fmt.Fprintf(os.Stderr, "created %d VMs and %d exposures in %s\n", c.hosts*c.vms, c.hosts, created.Round(time.Millisecond))

	steps := make([]func(), len(hosts))
	for i, h := range hosts {
		steps[i] = h.step
	}
	title := "control plane"
	if c.multi() {
		title += " (" + v.String() + ")"
	}
	res, err := measure(ctx, c, target{title: title, who: "control-plane", srvs: srvs, urls: urls, token: token,
		tr: tr, steps: steps, reports: &reports, pg: pg})
	if err != nil {
		return result{}, err
	}
	res.title = v.String()
	res.created = created
	if c.benchfmt != "" {
		if err := writeBench(c, v, res); err != nil {
			return result{}, err
		}
	}
	stop()
	return res, nil
}

// target is a server under measurement and what feeds it: one step per
// simulated host (its next narration beat), the tracks those changes are
// stamped in, and a count of the changed reports that left.
type target struct {
	title string // the block's heading
	who   string // the server in the block's lines ("control-plane")
	// srvs are its processes (the replicas) and urls where each answers;
	// watcher i watches through urls[i mod len(urls)].
	srvs    []*server
	urls    []string
	token   string
	pg      *postgres // the replicas' database, nil on SQLite
	tr      *tracks
	steps   []func()
	reports *atomic.Int64
}

// result is what a measurement found, for the comparison.
type result struct {
	title                        string
	rate                         float64 // changed reports absorbed per second
	p50, p99, crossP50, crossP99 time.Duration
	crossN                       int
	delivered, crossDelivered    float64 // %
	cpu                          []float64
	pgCPU                        float64 // cores; 0 without PostgreSQL
	perChange                    float64 // µs of server-side CPU per change made
	load                         string
	// For -benchfmt: the whole control plane's cores and RSS, how long
	// the hosts' VMs took to create and the watchers to open (each got
	// every VM or exposure in its first message).
	cores           float64
	rss             int64
	created, opened time.Duration
}

// measure opens the watchers on t, narrates for c.dur, waits for the
// latest state to arrive and prints the block.
func measure(ctx context.Context, c config, t target) (result, error) {
	srvs, tr, reports := t.srvs, t.tr, t.reports
	// The watchers.
	t0 := time.Now()
	ws := make([]*watcher, c.watchers)
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	var wwg sync.WaitGroup
	for i := range ws {
		w := &watcher{kind: "vms", grpc: i%2 == 1, replica: i % len(t.urls), seen: map[string]uint64{}, connected: make(chan struct{})}
		if i%4 >= 2 {
			w.kind = "exposures"
		}
		ws[i] = w
		wwg.Go(func() { w.run(wctx, t.urls[w.replica], t.token, tr) })
		if i%50 == 49 {
			<-w.connected // don't open a thousand TLS handshakes at once
		}
	}
	for _, w := range ws {
		<-w.connected
		if w.err != nil {
			return result{}, fmt.Errorf("watcher (%s, grpc=%v): %w", w.kind, w.grpc, w.err)
		}
	}
	opened := time.Since(t0)
	fmt.Fprintf(os.Stderr, "opened %d watchers in %s\n", c.watchers, opened.Round(time.Millisecond))

	var probe *watcher
	if c.dbprobe && t.pg != nil {
		probe = t.pg.probe(wctx, tr)
	}

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

	type reading struct {
		cpu, wait   time.Duration
		rss, writes int64
	}
	read := func() []reading {
		rs := make([]reading, len(srvs))
		for i, s := range srvs {
			cpu, rss, _ := s.usage()
			pid := s.cmd.Process.Pid
			rs[i] = reading{cpu: cpu, rss: rss, wait: runWait(pid), writes: writeCalls(pid)}
		}
		return rs
	}
	pgCPU := func() time.Duration {
		if t.pg == nil {
			return 0
		}
		return t.pg.cpu()
	}
	warns := func() []int {
		out := make([]int, len(srvs))
		for i, s := range srvs {
			out[i], _ = s.warnings()
		}
		return out
	}
	// The window opens once the load has run for a while: it measures the
	// steady state, not the first seconds after the setup's thousands of
	// creates and watch snapshots.
	select {
	case <-ctx.Done():
		ncancel()
		nwg.Wait()
		return result{}, ctx.Err()
	case <-time.After(c.warmup):
	}
	var db0, db1 dbStats
	if t.pg != nil {
		db0 = t.pg.stats(ctx)
	}
	warn0 := warns()
	var locks0, locks1 [3]int64
	if probe != nil {
		locks0 = t.pg.lockCounters()
	}
	before, pg0 := read(), pgCPU()
	self0 := selfCPU()
	selfWait0 := runWait(os.Getpid())
	r0, n0 := reports.Load(), tr.n.Load()
	from := time.Now()
	tr.from.Store(from.UnixNano())
	time.Sleep(c.dur)
	ncancel()
	nwg.Wait()
	to := time.Now()
	after, pg1 := read(), pgCPU()
	warn1 := warns()
	if probe != nil {
		locks1 = t.pg.lockCounters()
	}
	if t.pg != nil {
		db1 = t.pg.stats(ctx)
	}
	self1 := selfCPU()
	selfWait1 := runWait(os.Getpid())
	r1, n1 := reports.Load(), tr.n.Load()
	window := to.Sub(from)
	var cpu, wait time.Duration
	var rss, writes int64
	for i := range after {
		cpu += after[i].cpu - before[i].cpu
		wait += after[i].wait - before[i].wait
		writes += after[i].writes - before[i].writes
		rss += after[i].rss
	}

	// Drain: wait for every watcher to hold every object's latest state.
	home := map[string]int{}
	objs := func(kind string) map[string]uint64 {
		tr.mu.Lock()
		defer tr.mu.Unlock()
		out := map[string]uint64{}
		for o, s := range tr.latest {
			if tr.kind[o] == kind {
				out[o] = s
				home[o] = tr.home[o]
			}
		}
		return out
	}
	// Let the last reports leave the agents (they are sent at once, or
	// at their next tick).
	time.Sleep(1500 * time.Millisecond)
	want := map[string]map[string]uint64{"vms": objs("vms"), "exposures": objs("exposures")}
	var pairs, got, crossPairs, crossGot int
	deadline := time.Now().Add(c.drain)
	for {
		pairs, got, crossPairs, crossGot = 0, 0, 0, 0
		for _, w := range ws {
			w.mu.Lock()
			for o, s := range want[w.kind] {
				ok := w.seen[o] >= s
				pairs++
				if ok {
					got++
				}
				if home[o] != w.replica {
					crossPairs++
					if ok {
						crossGot++
					}
				}
			}
			w.mu.Unlock()
		}
		if got == pairs || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	var allocMB int64
	var gcs int
	for _, s := range srvs {
		mb, n := s.allocated(from, to)
		allocMB, gcs = allocMB+mb, gcs+n
	}
	wcancel()
	wwg.Wait()

	var lat, cross, same []time.Duration
	var errs []error
	var deliveries int64
	// Cross-replica latency by when the change was sent, in quarters of
	// the window: a p99 that grows from one to the next is a lag that
	// builds up, a steady one a cost.
	quarters := make([][]time.Duration, 4)
	for _, w := range ws {
		lat = append(lat, w.lat...)
		same = append(same, w.same...)
		for _, s := range w.cross {
			cross = append(cross, s.d)
			q := min(3, max(0, int(4*s.at.Sub(from)/window)))
			quarters[q] = append(quarters[q], s.d)
		}
		deliveries += w.msgs
		if w.err != nil {
			errs = append(errs, w.err)
		}
	}
	slices.Sort(lat)
	slices.Sort(cross)
	slices.Sort(same)
	for _, q := range quarters {
		slices.Sort(q)
	}
	changes := n1 - n0
	res := result{
		rate: float64(r1-r0) / window.Seconds(), p50: pct(lat, 50), p99: pct(lat, 99),
		crossP50: pct(cross, 50), crossP99: pct(cross, 99), crossN: len(cross),
		delivered: 100 * float64(got) / float64(max(pairs, 1)), crossDelivered: 100 * float64(crossGot) / float64(max(crossPairs, 1)),
		pgCPU:     (pg1 - pg0).Seconds() / window.Seconds(),
		perChange: float64((cpu + pg1 - pg0).Microseconds()) / float64(max(changes, 1)),
		load:      loadavg(),
		cores:     cpu.Seconds() / window.Seconds(),
		rss:       rss,
		opened:    opened,
	}
	for i := range after {
		res.cpu = append(res.cpu, (after[i].cpu-before[i].cpu).Seconds()/window.Seconds())
	}

	fmt.Printf("%s: hosts=%d vms/host=%d watchers=%d (vms/exposures × connect/grpc) window=%s load1=%s\n",
		t.title, c.hosts, c.vms, c.watchers, window.Round(time.Millisecond), res.load)
	fmt.Printf("  reports/s absorbed      %.1f (changed reports; %d changes to %d objects)\n", res.rate, changes, pairsObjs(want))
	fmt.Printf("  report→watcher          p50=%s p99=%s max=%s (%d deliveries of a new value)\n", res.p50, res.p99, pct(lat, 100), len(lat))
	fmt.Printf("  latest state delivered  %.2f%% (%d of %d watcher×object pairs, %s after the last change)\n", res.delivered, got, pairs, c.drain)
	together := ""
	if len(srvs) > 1 {
		together = fmt.Sprintf(" (%d replicas together)", len(srvs))
	}
	fmt.Printf("  %-24s%.2f cores, RSS %d MiB%s\n", t.who+" CPU", cpu.Seconds()/window.Seconds(), rss>>20, together)
	fmt.Printf("  %-24s%.1f KiB per delivered message (%d MiB over %d GCs; %d messages received by watchers)\n",
		t.who+" alloc", float64(allocMB<<10)/float64(max(deliveries, 1)), allocMB, gcs, deliveries)
	fmt.Printf("  CPU per delivery        %.1f µs (%s CPU / messages received by watchers)\n",
		float64(cpu.Microseconds())/float64(max(deliveries, 1)), t.who)
	if writes > 0 {
		fmt.Printf("  writes                  %.0f/s, %.1f µs of %s CPU per write (write system calls, /proc/pid/io)\n",
			float64(writes)/window.Seconds(), float64(cpu.Microseconds())/float64(writes), t.who)
	}
	if c.multi() && t.who == "control-plane" {
		if len(srvs) > 1 {
			fmt.Printf("  cross-replica watchers  p50=%s p99=%s max=%s (%d deliveries to a watcher on another replica than the agent's)\n",
				res.crossP50, res.crossP99, pct(cross, 100), len(cross))
			fmt.Printf("  latest, cross-replica   %.2f%% (%d of %d watcher×object pairs)\n", res.crossDelivered, crossGot, crossPairs)
			fmt.Printf("  same-replica watchers   p50=%s p99=%s max=%s (%d deliveries)\n", pct(same, 50), pct(same, 99), pct(same, 100), len(same))
			var qs []string
			for i, q := range quarters {
				qs = append(qs, fmt.Sprintf("%d/4 p50=%s p99=%s", i+1, pct(q, 50), pct(q, 99)))
			}
			fmt.Printf("  cross, by send time     %s (quarters of the window)\n", strings.Join(qs, ", "))
			if probe != nil {
				probe.mu.Lock()
				pl := slices.Clone(probe.lat)
				probe.mu.Unlock()
				slices.Sort(pl)
				fmt.Printf("  agent→database          p50=%s p99=%s max=%s (%d changes first seen in host_live; polled every 10 ms)\n",
					pct(pl, 50), pct(pl, 99), pct(pl, 100), len(pl))
				n := float64(max(locks1[0]-locks0[0], 1))
				fmt.Printf("  advisory locks          %.2f sessions waiting on average, one held in %.0f%% of %.0f samples in the window (pg_locks every 20 ms)\n",
					float64(locks1[1]-locks0[1])/n, 100*float64(locks1[2]-locks0[2])/n, n)
			}
			var per []string
			for i := range after {
				per = append(per, fmt.Sprintf("%d: %.2f cores, RSS %d MiB", i+1, res.cpu[i], after[i].rss>>20))
			}
			fmt.Printf("  each replica            %s\n", strings.Join(per, "; "))
		} else {
			fmt.Printf("  cross-replica watchers  none (one replica)\n")
		}
		if t.pg != nil {
			fmt.Printf("  PostgreSQL CPU          %.2f cores (its processes' utime+stime, /proc/PID/stat)\n", res.pgCPU)
			fmt.Printf("  PostgreSQL xacts        %.0f commits/s, %.0f rollbacks/s; errors logged: %s\n",
				float64(db1.commits-db0.commits)/window.Seconds(), float64(db1.rollbacks-db0.rollbacks)/window.Seconds(), t.pg.logErrors(db0.logAt))
			fmt.Printf("  change feed             %s (durable writes in the window, which every other replica follows)\n", t.pg.feed(ctx, db0.rev, db1.rev))
		} else {
			fmt.Printf("  PostgreSQL CPU          none (SQLite, in the control plane's process)\n")
		}
		fmt.Printf("  CPU per change          %.1f µs (control plane + database CPU / %d changes made in the window)\n", res.perChange, changes)
		for i, s := range srvs {
			if n := warn1[i] - warn0[i]; n > 0 {
				_, kinds := s.warnings()
				fmt.Printf("  replica %d warned       %d times in the window (%s)\n", i+1, n, kinds)
			}
		}
	}
	fmt.Printf("  simulator CPU           %.2f cores (its agents and watchers, on the same machine)\n", (self1-self0).Seconds()/window.Seconds())
	fmt.Printf("  waiting for a CPU       %s %.2f, simulator %.2f (thread-seconds runnable but not running, per second)\n",
		strings.ReplaceAll(t.who, "-", " "), wait.Seconds()/window.Seconds(), (selfWait1-selfWait0).Seconds()/window.Seconds())
	if len(errs) > 0 {
		fmt.Printf("  watcher errors          %d (first: %v)\n", len(errs), errs[0])
	}
	return res, nil
}

// compare prints the configurations measured side by side; the first is
// what the others' cost per change is compared with.
func compare(c config, rs []result) {
	fmt.Printf("comparison (hosts=%d vms/host=%d watchers=%d, %s windows; cross = watchers on a replica other than the agent's):\n",
		c.hosts, c.vms, c.watchers, c.dur)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "  "+strings.Repeat(" ", 24)+"\tp50\tp99\tcross p50\tcross p99\tdelivered\tcontrol-plane CPU\tPostgreSQL CPU\tCPU per change\tload1\t")
	for _, r := range rs {
		var cpus []string
		sum := 0.0
		for _, x := range r.cpu {
			cpus = append(cpus, fmt.Sprintf("%.2f", x))
			sum += x
		}
		cp := fmt.Sprintf("%.2f", sum)
		if len(cpus) > 1 {
			cp = strings.Join(cpus, "+") + " = " + cp
		}
		crossP50, crossP99, pgc := "-", "-", "-"
		if r.crossN > 0 {
			crossP50, crossP99 = r.crossP50.Round(100*time.Microsecond).String(), r.crossP99.Round(100*time.Microsecond).String()
		}
		if len(r.cpu) > 1 || r.pgCPU > 0 {
			pgc = fmt.Sprintf("%.2f", r.pgCPU)
		}
		fmt.Fprintf(tw, "  %-24s\t%s\t%s\t%s\t%s\t%.2f%%\t%s\t%s\t%.0f µs (×%.2f)\t%s\t\n", r.title,
			r.p50.Round(100*time.Microsecond), r.p99.Round(100*time.Microsecond), crossP50, crossP99, r.delivered, cp, pgc,
			r.perChange, r.perChange/max(rs[0].perChange, 0.001), r.load)
	}
	tw.Flush()
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

// writeBench appends r to c.benchfmt as Go benchmark lines, one per thing
// measured, so that benchstat compares two builds' files: the fan-out
// (latency, CPU, memory, delivery), the creates and the watchers' opening.
// Lower is better in every unit but delivered-%.
func writeBench(c config, v variant, r result) error {
	f, err := os.OpenFile(c.benchfmt, os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	name := fmt.Sprintf("hosts=%d/vms=%d/watchers=%d/db=%s/replicas=%d", c.hosts, c.vms, c.watchers, v.db, v.replicas)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	lines := []string{
		fmt.Sprintf("BenchmarkScaleFanOut/%s 1 %.3f p50-ms %.3f p99-ms %.3f cores %d RSS-MiB %.2f µs/change %.2f delivered-%%",
			name, ms(r.p50), ms(r.p99), r.cores, r.rss>>20, r.perChange, r.delivered),
		fmt.Sprintf("BenchmarkScaleCreateVM/%s 1 %.3f ms/vm", name, ms(r.created)/float64(max(c.hosts*c.vms, 1))),
		fmt.Sprintf("BenchmarkScaleOpenWatch/%s 1 %.3f ms/watcher", name, ms(r.opened)/float64(max(c.watchers, 1))),
	}
	if v.replicas > 1 {
		lines = append(lines, fmt.Sprintf("BenchmarkScaleCrossReplica/%s 1 %.3f p50-ms %.3f p99-ms %.2f delivered-%%",
			name, ms(r.crossP50), ms(r.crossP99), r.crossDelivered))
	}
	_, err = fmt.Fprintln(f, strings.Join(lines, "\n"))
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}
