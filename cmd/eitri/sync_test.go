package main

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/wire/jointoken"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/syncclient"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/auth"
)

// source stands in for the agent's node: it records snapshots and reports
// whatever the test sets.
type source struct {
	mu    sync.Mutex
	snaps []*eitriv1.DesiredStateSnapshot
	vms   []*eitriv1.ActualVM
	fills int
}

func (s *source) Apply(snap *eitriv1.DesiredStateSnapshot) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.snaps = append(s.snaps, snap)
	return true
}

func (s *source) Fill(rep *eitriv1.ActualStateReport) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.fills++
	rep.Vms = s.vms
	rep.Capacity = &eitriv1.Capacity{Vcpus: 4, MemMb: 8192, DiskGb: 100}
}

func (s *source) last() *eitriv1.DesiredStateSnapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.snaps) == 0 {
		return nil
	}
	return s.snaps[len(s.snaps)-1]
}

// controlPlane serves a real TLS control plane on a loopback port; restart
// brings it back on the same port and data, as an operator restart would.
type controlPlane struct {
	t      *testing.T
	dir    string
	addr   string
	srv    *server.Server
	cancel context.CancelFunc
	done   chan struct{}
}

func startControlPlane(t *testing.T, dir, addr string) *controlPlane {
	t.Helper()
	return startControlPlaneWith(t, addr, server.Config{DataDir: dir})
}

// startControlPlaneWith listens on addr and serves a control plane made
// with cfg there; its public URL is https://addr unless cfg names one.
func startControlPlaneWith(t *testing.T, addr string, cfg server.Config) *controlPlane {
	t.Helper()
	ln, err := net.Listen("tcp", addr)
	require.NoError(t, err)
	if cfg.PublicURL == "" {
		cfg.PublicURL = "https://" + ln.Addr().String()
	}
	return serveControlPlane(t, ln, cfg)
}

// serveControlPlane makes a control plane with cfg and serves it on ln
// until stop or the end of the test.
func serveControlPlane(t *testing.T, ln net.Listener, cfg server.Config) *controlPlane {
	t.Helper()
	srv, err := server.New(context.Background(), cfg)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cp := &controlPlane{t: t, dir: cfg.DataDir, addr: ln.Addr().String(), srv: srv, cancel: cancel, done: make(chan struct{})}
	go func() { _ = srv.Serve(ctx, ln); close(cp.done) }()
	t.Cleanup(cp.stop)
	return cp
}

func (cp *controlPlane) stop() {
	cp.cancel()
	<-cp.done
	cp.srv.Close()
}

// admin is a request context acting as the first admin, whose token the
// first start wrote to the data directory.
func (cp *controlPlane) admin() context.Context {
	cp.t.Helper()
	p, err := cp.srv.Fleet.Resolve(context.Background(), tokenIn(cp.t, cp.dir))
	require.NoError(cp.t, err)
	return auth.WithPrincipal(context.Background(), p)
}

// enroll enrolls a host named h1 with a join token made through cp by the
// caller of ctx.
func (cp *controlPlane) enroll(ctx context.Context) state.Identity {
	cp.t.Helper()
	jt, err := cp.srv.Fleet.CreateJoinToken(ctx, time.Minute)
	require.NoError(cp.t, err)
	id, err := syncclient.Enroll(context.Background(), jt.Token, "h1", "test")
	require.NoError(cp.t, err)
	return id
}

// tokenIn is the admin token the first start wrote to dir.
func tokenIn(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "admin.token"))
	require.NoError(t, err)
	return strings.TrimSpace(string(b))
}

func TestTheAgentStreamHealsAcrossAControlPlaneRestart(t *testing.T) {
	dir := t.TempDir()
	cp := startControlPlane(t, dir, "127.0.0.1:0")
	id := cp.enroll(cp.admin())
	// Enrolling pins the certificate carried in the token.
	assert.Equal(t, cp.srv.Fingerprint, id.Fingerprint)

	src := &source{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	startAgentStream(ctx, quickAgent(id, src, ""))
	require.Eventually(t, func() bool { return src.last() != nil }, 10*time.Second, 10*time.Millisecond, "a connect earns a snapshot")
	require.Eventually(t, func() bool {
		h, err := cp.srv.Fleet.GetHost(cp.admin(), id.HostID)
		return err == nil && h.Connected && h.Capacity.GetVcpus() == 4
	}, 10*time.Second, 10*time.Millisecond, "the first report reaches the control plane")

	// Place a VM: its snapshot reaches the agent; the agent's narration
	// reaches the API.
	vm, err := cp.srv.Fleet.CreateVM(cp.admin(), &eitriv1.CreateVMRequest{
		Name: "web-1", ImageUrl: "http://x/y.raw", ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		Vcpus: 1, MemMb: 256, DiskGb: 1,
	})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(src.last().GetVms()) == 1 }, 10*time.Second, 10*time.Millisecond)
	gen := src.last().GetGeneration()

	src.mu.Lock()
	src.vms = []*eitriv1.ActualVM{{VmId: vm.Id, Power: "stopped", Phase: "creating", StatusDetail: "preparing root disk"}}
	src.mu.Unlock()
	require.Eventually(t, func() bool {
		v, err := cp.srv.Fleet.GetVM(cp.admin(), vm.Id)
		return err == nil && v.StatusDetail == "preparing root disk"
	}, 10*time.Second, 10*time.Millisecond, "a changed aggregate is sent without being asked")

	// Restart the control plane on the same port and data: the agent comes
	// back by itself, gets a newer snapshot and resends its full report.
	addr := cp.addr
	cp.stop()
	cp2 := startControlPlane(t, dir, addr)
	require.Eventually(t, func() bool {
		v, err := cp2.srv.Fleet.GetVM(cp2.admin(), vm.Id)
		return err == nil && v.StatusDetail == "preparing root disk" && v.Lifecycle == "creating"
	}, 20*time.Second, 20*time.Millisecond, "the live state is rebuilt from the resent report")
	require.Eventually(t, func() bool { return src.last().GetGeneration() > gen }, 10*time.Second, 10*time.Millisecond,
		"the new control plane sends a snapshot whose generation is above the old one's")
}

func TestEnrollRefusesACertificateThatDoesNotMatchThePin(t *testing.T) {
	cp := startControlPlane(t, t.TempDir(), "127.0.0.1:0")
	jt, err := cp.srv.Fleet.CreateJoinToken(cp.admin(), time.Minute)
	require.NoError(t, err)
	tok, err := jointoken.Decode(jt.Token)
	require.NoError(t, err)

	// The same token pinned to another certificate: a man in the middle.
	other := startControlPlane(t, t.TempDir(), "127.0.0.1:0")
	tok.CertFingerprint = other.srv.Fingerprint
	forged := jointoken.Encode(tok)
	_, err = syncclient.Enroll(context.Background(), forged, "h1", "test")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "does not match the pinned")

	_, err = syncclient.Enroll(context.Background(), jt.Token, "h1", "test")
	require.NoError(t, err, "the genuine token still works: the failed attempt spent nothing")
	_, err = syncclient.Enroll(context.Background(), jt.Token, "h2", "test")
	assert.Equal(t, connect.CodeUnauthenticated, connect.CodeOf(err), "and only once")
}

// runAgentStream runs a quick agent (the process instance) for id until
// the test ends, logging into logs, and returns what it was sent.
func runAgentStream(t *testing.T, id state.Identity, instance string, logs *hosttest.LogBuffer) *source {
	t.Helper()
	src := &source{}
	cfg := quickAgent(id, src, instance)
	cfg.Log = logs.Logger()
	ctx, cancel := context.WithCancel(context.Background())
	done := startAgentStream(ctx, cfg)
	t.Cleanup(func() { cancel(); <-done })
	return src
}

func TestAnAgentSaysWhyItWillNotTalkToAnImposter(t *testing.T) {
	cp := startControlPlane(t, t.TempDir(), "127.0.0.1:0")
	id := cp.enroll(cp.admin())

	// Another control plane (another certificate) where the real one was.
	addr := cp.addr
	cp.stop()
	imposter := startControlPlane(t, t.TempDir(), addr)
	var logs hosttest.LogBuffer
	runAgentStream(t, id, "a", &logs)
	require.Eventually(t, func() bool { return strings.Contains(logs.String(), "does not match the pinned") }, 10*time.Second, 20*time.Millisecond,
		"the agent's log names the refused certificate, not just a lost stream:\n%s", logs.String())
	hosts, err := imposter.srv.Fleet.ListHosts(imposter.admin())
	require.NoError(t, err)
	assert.Empty(t, hosts, "the imposter learned of no host")
}

func TestASecondAgentWithOneIdentityIsRefusedAndBacksOff(t *testing.T) {
	cp := startControlPlane(t, t.TempDir(), "127.0.0.1:0")
	id := cp.enroll(cp.admin())

	var firstLogs, cloneLogs hosttest.LogBuffer
	first := runAgentStream(t, id, "first", &firstLogs)
	require.Eventually(t, func() bool { return first.last() != nil }, 10*time.Second, 10*time.Millisecond)

	runAgentStream(t, id, "clone", &cloneLogs)
	require.Eventually(t, func() bool { return strings.Contains(cloneLogs.String(), "refused this agent") }, 10*time.Second, 20*time.Millisecond)
	assert.Contains(t, cloneLogs.String(), "new join token", "the refused agent is told what to do")

	h, err := cp.srv.Fleet.GetHost(cp.admin(), id.HostID)
	require.NoError(t, err)
	assert.True(t, h.Connected)
	require.Len(t, h.Conditions, 1)
	assert.Equal(t, "duplicate_agent", h.Conditions[0].Type)

	// Seconds, not the 50 ms this client would otherwise retry at: in two
	// seconds the clone tries once, and the first agent is never replaced.
	time.Sleep(2 * time.Second)
	assert.Equal(t, 1, strings.Count(cloneLogs.String(), "refused this agent"), cloneLogs.String())
	assert.NotContains(t, firstLogs.String(), "stream lost", "the first agent's stream was never replaced")
}

// TestAnAgentEnrolledWithSeveralURLsFailsOverBetweenThem serves one control
// plane at two addresses (two replicas with one serving identity, as far as
// an agent can tell) and names a third that is down: the join token carries
// all three, the agent enrolls and streams through a live one, and when the
// address it is on goes away it is back through the other.
func TestAnAgentEnrolledWithSeveralURLsFailsOverBetweenThem(t *testing.T) {
	deadURL := "https://" + freeAddr(t)
	lnA, lnB := loopback(t), loopback(t)
	urlA, urlB := "https://"+lnA.Addr().String(), "https://"+lnB.Addr().String()
	dir := t.TempDir()
	srv, err := server.New(context.Background(), server.Config{DataDir: dir, PublicURL: deadURL + "," + urlA + "," + urlB})
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	stopA := serveOn(srv, lnA)
	t.Cleanup(serveOn(srv, lnB))
	cp := &controlPlane{t: t, dir: dir, srv: srv}

	jt, err := srv.Fleet.CreateJoinToken(cp.admin(), time.Minute)
	require.NoError(t, err)
	id, err := syncclient.Enroll(context.Background(), jt.Token, "h1", "test")
	require.NoError(t, err, "enrolling skips the replica that is down")
	assert.Equal(t, []string{deadURL, urlA, urlB}, id.URLs())

	src := &source{}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	startAgentStream(ctx, quickAgent(id, src, ""))
	connected := func() bool {
		h, err := srv.Fleet.GetHost(cp.admin(), id.HostID)
		return err == nil && h.Connected
	}
	require.Eventually(t, connected, 10*time.Second, 10*time.Millisecond)
	snaps := func() int {
		src.mu.Lock()
		defer src.mu.Unlock()
		return len(src.snaps)
	}
	before := snaps()
	stopA()
	// Every connect earns a snapshot, and nothing else changes here: one
	// more snapshot is the stream re-opened, through B (A is gone).
	require.Eventually(t, func() bool { return snaps() > before && connected() }, 15*time.Second, 10*time.Millisecond,
		"the agent is back through B")
}

// quickAgent is a quick test agent's Sync stream for id with src: the
// agent process named instance ("" as older agents), reporting every 20 ms
// and back within 200 ms of a lost stream.
func quickAgent(id state.Identity, src syncclient.Source, instance string) syncclient.Config {
	return syncclient.Config{
		Identity: id, Source: src, ReportEvery: 20 * time.Millisecond, Heartbeat: time.Second,
		MinBackoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
		Hello: func() *eitriv1.Hello {
			return &eitriv1.Hello{AgentVersion: "test", Accelerator: "tcg", InstanceId: instance}
		},
	}
}

// startAgentStream runs cfg's Sync stream until ctx ends; done is closed
// once it has.
func startAgentStream(ctx context.Context, cfg syncclient.Config) (done <-chan struct{}) {
	c := make(chan struct{})
	go func() {
		defer close(c)
		_ = syncclient.Run(ctx, cfg)
	}()
	return c
}

// loopback is a listener on a free loopback port.
func loopback(t *testing.T) net.Listener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	return ln
}

// freeAddr is a loopback address nothing listens on (for a process to
// take).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln := loopback(t)
	defer ln.Close()
	return ln.Addr().String()
}

// serveOn serves srv on ln until stop: one more address of the same
// control plane, as a replica with the same identity looks to a client.
func serveOn(srv *server.Server, ln net.Listener) (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, ln); close(done) }()
	return func() { cancel(); <-done }
}
