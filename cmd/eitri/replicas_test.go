package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/a73x/eitri/agent/consolerelay"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/syncclient"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/server/store/pgtest"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/vmstate"
)

func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }

// replica is one eitri server process's worth of control plane on a shared
// PostgreSQL, served over h2c on loopback at url.
type replica struct {
	*controlPlane
	url string
}

func startReplica(t *testing.T, db string) *replica {
	t.Helper()
	return startReplicas(t, db, 1)[0]
}

// startReplicas starts n replicas, each advertising its own URL and
// naming all of theirs in join tokens.
func startReplicas(t *testing.T, db string, n int) []*replica {
	t.Helper()
	var lns []net.Listener
	var urls []string
	for range n {
		ln := loopback(t)
		lns = append(lns, ln)
		urls = append(urls, "http://"+ln.Addr().String())
	}
	var out []*replica
	for i, ln := range lns {
		cp := serveControlPlane(t, ln, server.Config{DataDir: t.TempDir(), DB: db, Plaintext: true,
			PublicURL: strings.Join(urls, ","), AdvertiseURL: urls[i]})
		out = append(out, &replica{controlPlane: cp, url: urls[i]})
	}
	return out
}

func (r *replica) as(t *testing.T, token string) context.Context {
	t.Helper()
	p, err := r.srv.Fleet.Resolve(context.Background(), token)
	require.NoError(t, err)
	return auth.WithPrincipal(context.Background(), p)
}

// TestReplicasOnOnePostgreSQLAreOneFleet runs two replicas and one agent:
// what is written through one replica reaches the other's watchers and the
// agent's stream on the other, what the agent narrates through one is seen
// on the other within the second, a second agent with the host's identity
// is refused on either, and when the agent's replica goes away the agent
// is back through the other.
func TestReplicasOnOnePostgreSQLAreOneFleet(t *testing.T) {
	db := pgtest.DSN(t)
	a := startReplica(t, db)
	b := startReplica(t, db)
	token := a.srv.AdminToken
	require.NotEmpty(t, token)
	onA, onB := a.as(t, token), b.as(t, token)

	// The agent enrolls through b, knowing both.
	id := b.enroll(onB)
	id.ServerURLs = []string{b.url, a.url}
	src := &source{}
	agentCtx, stopAgent := context.WithCancel(context.Background())
	defer stopAgent()
	startAgentStream(agentCtx, quickAgent(id, src, "agent-1"))

	connectedOn := func(r *replica, ctx context.Context) func() bool {
		return func() bool {
			h, err := r.srv.Fleet.GetHost(ctx, id.HostID)
			return err == nil && h.Connected && h.Capacity.GetVcpus() == 4
		}
	}
	require.Eventually(t, connectedOn(b, onB), 10*time.Second, 10*time.Millisecond, "the agent is on b")
	require.Eventually(t, connectedOn(a, onA), 10*time.Second, 10*time.Millisecond, "a shows what b's host said")

	// A watcher on a; a VM created through a, on the host b holds.
	w, _, err := a.srv.Fleet.WatchVMs(onA, "")
	require.NoError(t, err)
	defer w.Close()
	vm, err := a.srv.Fleet.CreateVM(onA, &eitriv1.CreateVMRequest{
		Name: "web-1", ImageUrl: "http://x/y.raw", ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		Vcpus: 1, MemMb: 256, DiskGb: 1,
	})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(src.last().GetVms()) == 1 }, 10*time.Second, 10*time.Millisecond,
		"the desired change made through a reached the agent's stream on b")

	// The agent narrates through b; a's watcher hears every step, in order.
	steps := []string{"downloading image", "preparing root disk", "booting"}
	seen := make(chan string, 100)
	watchCtx, stopWatch := context.WithCancel(context.Background())
	defer stopWatch()
	go func() {
		for {
			evs, err := w.Next(watchCtx)
			if err != nil {
				return
			}
			for _, ev := range evs {
				if ev.ID == vm.Id && ev.Obj != nil && ev.Obj.StatusDetail != "" {
					seen <- ev.Obj.StatusDetail
				}
			}
		}
	}()
	for _, step := range steps {
		src.mu.Lock()
		src.vms = []*eitriv1.ActualVM{{VmId: vm.Id, Power: vmstate.PowerStopped, Phase: vmstate.PhaseCreating, StatusDetail: step}}
		src.mu.Unlock()
		deadline := time.After(5 * time.Second)
	wait:
		for {
			select {
			case got := <-seen:
				if got == step {
					break wait
				}
				assert.Contains(t, steps, got)
			case <-deadline:
				t.Fatalf("a's watcher never heard %q", step)
			}
		}
	}

	// A second agent process with the host's identity is refused through
	// a, though a holds no stream of the host itself.
	imposter := &source{}
	impCtx, stopImp := context.WithCancel(context.Background())
	solo := id
	solo.ServerURLs = []string{a.url}
	startAgentStream(impCtx, quickAgent(solo, imposter, "agent-2"))
	require.Eventually(t, func() bool {
		h, err := a.srv.Fleet.GetHost(onA, id.HostID)
		return err == nil && len(h.Conditions) > 0 && h.Conditions[0].Type == "duplicate_agent"
	}, 5*time.Second, 20*time.Millisecond, "the refused imposter shows on the host")
	assert.Nil(t, imposter.last(), "the imposter never got a snapshot")
	stopImp()

	// b goes away: the agent is back through a, and a's view follows it.
	b.stop()
	require.Eventually(t, func() bool {
		v, err := a.srv.Fleet.GetVM(onA, vm.Id)
		return err == nil && v.StatusDetail == "booting"
	}, 15*time.Second, 20*time.Millisecond)
	require.Eventually(t, connectedOn(a, onA), 15*time.Second, 20*time.Millisecond, "the agent is back, through a")
	_, err = a.srv.Fleet.SetPower(onA, vm.Id, vmstate.PowerStopped)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		vms := src.last().GetVms()
		return len(vms) == 1 && vms[0].GetPowerState() == vmstate.PowerStopped
	}, 10*time.Second, 10*time.Millisecond, "a's own stream now carries the desired state")
}

// TestTwoReplicasAskedForTheLastVMAQuotaAllowsAdmitExactlyOne races a create
// through each of two replicas, 50 times, when the caller's quota has room
// for one more VM: one gets it, the other the quota error, every time.
func TestTwoReplicasAskedForTheLastVMAQuotaAllowsAdmitExactlyOne(t *testing.T) {
	db := pgtest.DSN(t)
	a := startReplica(t, db)
	b := startReplica(t, db)
	onA, onB := a.as(t, a.srv.AdminToken), b.as(t, a.srv.AdminToken)
	id := a.enroll(onA)
	agentCtx, stopAgent := context.WithCancel(context.Background())
	defer stopAgent()
	startAgentStream(agentCtx, quickAgent(id, &source{}, "agent-1"))
	for _, r := range []*replica{a, b} {
		ctx := r.as(t, a.srv.AdminToken)
		require.Eventually(t, func() bool {
			h, err := r.srv.Fleet.GetHost(ctx, id.HostID)
			return err == nil && h.Connected && h.Capacity.GetVcpus() == 4
		}, 10*time.Second, 10*time.Millisecond, "both replicas can place on the host")
	}
	one := int64(1)
	_, err := a.srv.Fleet.SetQuota(onA, &eitriv1.SetQuotaRequest{Limits: &eitriv1.QuotaLimits{Vms: &one}})
	require.NoError(t, err)

	for round := range 50 {
		type result struct {
			vm  *eitriv1.VM
			err error
		}
		results := make(chan result, 2)
		start := make(chan struct{})
		for i, r := range []*replica{a, b} {
			ctx := []context.Context{onA, onB}[i]
			go func() {
				<-start
				vm, err := r.srv.Fleet.CreateVM(ctx, &eitriv1.CreateVMRequest{
					Name: fmt.Sprintf("r%d-%d", round, i), ImageUrl: "http://x/y.raw",
					ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
					Vcpus:       1, MemMb: 64, DiskGb: 1,
				})
				results <- result{vm, err}
			}()
		}
		close(start)
		var won *eitriv1.VM
		refused := 0
		for range 2 {
			r := <-results
			switch {
			case r.err == nil:
				require.Nil(t, won, "round %d: both replicas admitted the last VM", round)
				won = r.vm
			case fleet.KindOf(r.err) == fleet.Exhausted:
				assert.Contains(t, r.err.Error(), "quota: vms")
				refused++
			default:
				t.Fatalf("round %d: %v", round, r.err)
			}
		}
		require.NotNil(t, won, "round %d: neither replica admitted it", round)
		require.Equal(t, 1, refused, "round %d", round)
		// Deleting gives the VM (and its vCPU and memory) back for the
		// next round.
		_, err := a.srv.Fleet.DeleteVM(onA, won.Id)
		require.NoError(t, err)
	}
}

// TestReplicasShareOneIdentity starts two TLS replicas at once on an empty
// database, each with its own data dir: one makes the first admin, both
// present the same certificate (what agents and the CLI pin) and the same
// SSH CAs, and a CA rotated through one is what the other trusts soon
// after.
func TestReplicasShareOneIdentity(t *testing.T) {
	db := pgtest.DSN(t)
	type started struct {
		srv *server.Server
		err error
	}
	starts := make(chan started, 2)
	for range 2 {
		go func() {
			srv, err := server.New(context.Background(), server.Config{DataDir: t.TempDir(), DB: db, PublicURL: "https://127.0.0.1:7443"})
			starts <- started{srv, err}
		}()
	}
	var srvs []*server.Server
	for range 2 {
		s := <-starts
		require.NoError(t, s.err)
		t.Cleanup(func() { s.srv.Close() })
		srvs = append(srvs, s.srv)
	}
	a, b := srvs[0], srvs[1]
	if a.AdminToken == "" {
		a, b = b, a
	}
	require.NotEmpty(t, a.AdminToken, "one replica made the first admin")
	assert.Empty(t, b.AdminToken, "and only one")
	assert.Equal(t, a.Fingerprint, b.Fingerprint, "both present one certificate")

	pa, err := a.Fleet.Resolve(context.Background(), a.AdminToken)
	require.NoError(t, err)
	pb, err := b.Fleet.Resolve(context.Background(), a.AdminToken)
	require.NoError(t, err, "the admin's token works on either")
	onA, onB := auth.WithPrincipal(context.Background(), pa), auth.WithPrincipal(context.Background(), pb)
	keysA, err := a.Fleet.SSHCAKeys(onA)
	require.NoError(t, err)
	keysB, err := b.Fleet.SSHCAKeys(onB)
	require.NoError(t, err)
	assert.Equal(t, keysA.GetUserCaKeys()[0].GetPublicKey(), keysB.GetUserCaKeys()[0].GetPublicKey())
	assert.Equal(t, keysA.GetHostCaKeys()[0].GetPublicKey(), keysB.GetHostCaKeys()[0].GetPublicKey())

	rotated, err := a.Fleet.RotateSSHCA(onA, "user")
	require.NoError(t, err)
	newKey := rotated.GetUserCaKeys()[0].GetPublicKey()
	require.NotEqual(t, keysA.GetUserCaKeys()[0].GetPublicKey(), newKey)
	require.Eventually(t, func() bool {
		k, err := b.Fleet.SSHCAKeys(onB)
		return err == nil && k.GetUserCaKeys()[0].GetPublicKey() == newKey
	}, 10*time.Second, 20*time.Millisecond, "b takes the key a rotated to")
}

// TestAConsoleReachesAHostHeldByAnotherReplica streams a VM's
// serial console, and then a tunnel, through a replica that does not hold the VM's host: the
// call goes to the holder through the database, and the agent answers at
// the replica that asked.
func TestAConsoleReachesAHostHeldByAnotherReplica(t *testing.T) {
	db := pgtest.DSN(t)
	rs := startReplicas(t, db, 2)
	a, b := rs[0], rs[1]
	onB := b.as(t, a.srv.AdminToken)
	id := b.enroll(onB)
	id.ServerURLs = []string{b.url} // the agent's streams are on b
	qb, err := qemu.New(qemu.Config{Dir: t.TempDir()})
	require.NoError(t, err)
	guest := &loopGuest{running: map[string]bool{}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hc := syncclient.HTTPClient(id)
	agent := quickAgent(id, &source{}, "agent-1") // a copy of id: b only
	agent.Client = hc
	startAgentStream(ctx, agent)
	id.ServerURLs = []string{b.url, a.url} // it may answer at either
	go func() {
		_ = consolerelay.Run(ctx, consolerelay.Config{Client: hc, Identity: id, InstanceID: "agent-1", Serial: qb, Guests: guest.addr})
	}()
	onA := a.as(t, a.srv.AdminToken)
	require.Eventually(t, func() bool {
		h, err := a.srv.Fleet.GetHost(onA, id.HostID)
		return err == nil && h.Connected && h.Capacity != nil
	}, 10*time.Second, 10*time.Millisecond)

	vm, err := a.srv.Fleet.CreateVM(onA, &eitriv1.CreateVMRequest{Name: "con", HostId: id.HostID,
		ImageUrl: "http://images.test/g.raw", ImageSha256: strings.Repeat("ab", 32), Vcpus: 1, MemMb: 256, DiskGb: 1})
	require.NoError(t, err)
	require.NoError(t, os.MkdirAll(qb.VMDir(vm.Id), 0o700))
	require.NoError(t, os.WriteFile(filepath.Join(qb.VMDir(vm.Id), "serial.log"), []byte("booting on b's host\n"), 0o600))

	vms := eitriv1connect.NewVMServiceClient(connclient.HTTPClient(""), a.url, connect.WithInterceptors(connclient.Bearer(a.srv.AdminToken)))
	var got []byte
	require.Eventually(t, func() bool {
		st, err := vms.StreamConsole(ctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: vm.Id, NoFollow: true}))
		if err != nil {
			return false
		}
		defer st.Close()
		got = got[:0]
		for st.Receive() {
			got = append(got, st.Msg().GetData()...)
		}
		return st.Err() == nil && len(got) > 0
	}, 15*time.Second, 50*time.Millisecond, "a's console call reaches the host b holds")
	assert.Equal(t, "booting on b's host\n", string(got))

	// A tunnel (what eitri ssh rides) the same way.
	guest.run(vm.Id, true)
	echo := serveTCP(t, echoUntilEOF)
	st, err := openTunnel(ctx, vms, &eitriv1.OpenTunnelRequest{VmId: vm.Id, Port: echo, Data: []byte("hello ")})
	require.NoError(t, err)
	require.NoError(t, st.Send(&eitriv1.OpenTunnelRequest{Data: []byte("guest")}))
	require.NoError(t, st.CloseRequest())
	out, eof, err := readTunnel(st)
	require.NoError(t, err)
	assert.Equal(t, "hello guest[11 bytes]", out, "bytes crossed both ways through a and the agent on b")
	assert.True(t, eof)
}

// TestAReplicaThatLostAHostSendsItNothingMore opens a host's stream on a,
// lets the same agent process take it to b (as after a's freeze or a cut
// link), and asks a's stale session for a snapshot: it is refused, and the
// session ends, whatever a's memory still says.
func TestAReplicaThatLostAHostSendsItNothingMore(t *testing.T) {
	db := pgtest.DSN(t)
	rs := startReplicas(t, db, 2)
	a, b := rs[0], rs[1]
	onA := a.as(t, a.srv.AdminToken)
	id := a.enroll(onA)
	hello := func() *eitriv1.Hello {
		return &eitriv1.Hello{HostId: id.HostID, AgentVersion: "test", InstanceId: "agent-1"}
	}

	ctx := context.Background()
	old, err := a.srv.Fleet.OpenSession(ctx, id.HostID, hello(), "10.0.0.1:1")
	require.NoError(t, err)
	_, err = old.Snapshot(ctx)
	require.NoError(t, err, "a holds the host")

	moved, err := b.srv.Fleet.OpenSession(ctx, id.HostID, hello(), "10.0.0.1:2")
	require.NoError(t, err, "the same agent process takes its host to b")
	defer moved.Close()
	_, err = old.Snapshot(ctx)
	require.ErrorIs(t, err, fleet.ErrReplaced)
	select {
	case <-old.Context().Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a's stale session did not end")
	}
	_, err = moved.Snapshot(ctx)
	require.NoError(t, err, "b serves the host")
	old.Close()
	_, err = moved.Snapshot(ctx)
	require.NoError(t, err, "a's late close did not release b's claim")
}

// TestUsageMeasuredThroughOneReplicaIsChartedOnAnother: an agent on
// replica b sends usage samples; a usage watcher on replica a gets each of
// them once, in order, for the host and its VM, and a's window holds them.
func TestUsageMeasuredThroughOneReplicaIsChartedOnAnother(t *testing.T) {
	db := pgtest.DSN(t)
	a := startReplica(t, db)
	b := startReplica(t, db)
	token := a.srv.AdminToken
	onA, onB := a.as(t, token), b.as(t, token)

	id := b.enroll(onB)
	id.ServerURLs = []string{b.url}
	src := &source{}
	// Each sample's CPU seconds is its number: 1, 2, 3, ... The VM's
	// series starts once the VM exists.
	var n atomic.Int64
	var vmID atomic.Pointer[string]
	cfg := quickAgent(id, src, "agent-1")
	cfg.UsageEvery = 200 * time.Millisecond // several report writes (every 50 ms) between samples
	cfg.Usage = func(context.Context) *eitriv1.UsageSample {
		i := float64(n.Add(1))
		now := timestamppb.Now()
		u := &eitriv1.UsageSample{Host: &eitriv1.HostUsage{At: now, CpuBusySeconds: &i}}
		if v := vmID.Load(); v != nil {
			u.Vms = []*eitriv1.VMUsage{{VmId: *v, At: now, CpuSeconds: &i}}
		}
		return u
	}
	agentCtx, stopAgent := context.WithCancel(context.Background())
	defer stopAgent()
	startAgentStream(agentCtx, cfg)
	require.Eventually(t, func() bool {
		h, err := a.srv.Fleet.GetHost(onA, id.HostID)
		return err == nil && h.Connected && h.Capacity.GetVcpus() == 4
	}, 10*time.Second, 10*time.Millisecond, "a shows b's host")

	vm, err := a.srv.Fleet.CreateVM(onA, &eitriv1.CreateVMRequest{
		Name: "web-1", ImageUrl: "http://x/y.raw", ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		Vcpus: 1, MemMb: 256, DiskGb: 1,
	})
	require.NoError(t, err)
	src.mu.Lock()
	src.vms = []*eitriv1.ActualVM{{VmId: vm.Id, Power: vmstate.PowerRunning, Phase: vmstate.PhaseReady}}
	src.mu.Unlock()
	vmID.Store(&vm.Id)
	// The host's report changes between samples, so its row is rewritten
	// with the same sample on it several times.
	narrate, stopNarrating := context.WithCancel(context.Background())
	defer stopNarrating()
	go func() {
		for i := 0; narrate.Err() == nil; i++ {
			src.mu.Lock()
			src.vms = []*eitriv1.ActualVM{{VmId: vm.Id, Power: vmstate.PowerRunning, Phase: vmstate.PhaseReady, StatusDetail: fmt.Sprintf("step %d", i)}}
			src.mu.Unlock()
			time.Sleep(5 * time.Millisecond)
		}
	}()
	w, _, err := a.srv.Fleet.WatchUsage(onA, "", "")
	require.NoError(t, err)
	defer w.Close()

	// What a's watcher hears: strictly rising numbers per series (a sample
	// taken twice from a row rewritten for its report would repeat one),
	// until it has heard 5 of each.
	last, heard := map[string]float64{}, map[string]int{}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for heard["vm"] < 5 || heard["host"] < 5 {
		evs, err := w.Next(ctx)
		require.NoError(t, err, "a's watcher heard: %v", last)
		for _, ev := range evs {
			kind, cpu := "", 0.0
			switch e := ev.Obj.GetEvent().(type) {
			case *eitriv1.WatchUsageResponse_Vm:
				assert.Equal(t, vm.Id, e.Vm.GetVmId())
				assert.Equal(t, id.HostID, e.Vm.GetHostId())
				kind, cpu = "vm", e.Vm.GetCpuSeconds()
			case *eitriv1.WatchUsageResponse_Host:
				assert.Equal(t, id.HostID, e.Host.GetHostId())
				kind, cpu = "host", e.Host.GetCpuBusySeconds()
			default:
				continue
			}
			assert.Greater(t, cpu, last[kind], "%s samples arrive once each, in order", kind)
			last[kind] = cpu
			heard[kind]++
		}
	}
	_, win, err := a.srv.Fleet.WatchUsage(onA, vm.Id, "")
	require.NoError(t, err)
	require.GreaterOrEqual(t, len(win.GetVms()), 5, "a's window holds the VM's samples")
	for i, u := range win.GetVms() {
		assert.Equal(t, vm.Id, u.GetVmId())
		if i > 0 {
			assert.Greater(t, u.GetCpuSeconds(), win.GetVms()[i-1].GetCpuSeconds(), "oldest first, none twice")
		}
	}
}

// TestAHostsImageListingAnswersThroughAnyReplica: a host on replica b sends
// its image cache listing; `ListHostImages` through replica a answers with
// it, and once the host is gone, with nothing.
func TestAHostsImageListingAnswersThroughAnyReplica(t *testing.T) {
	db := pgtest.DSN(t)
	a := startReplica(t, db)
	b := startReplica(t, db)
	token := a.srv.AdminToken
	onA, onB := a.as(t, token), b.as(t, token)

	id := b.enroll(onB)
	id.ServerURLs = []string{b.url}
	sha := strings.Repeat("ab", 32)
	cfg := quickAgent(id, &source{}, "agent-1")
	cfg.ImageCache = func() *eitriv1.ImageCacheReport {
		return &eitriv1.ImageCacheReport{TotalBytes: 4 << 20, Images: []*eitriv1.CachedImage{{Sha256: sha, SizeBytes: 4 << 20, Pinned: true}}}
	}
	agentCtx, stopAgent := context.WithCancel(context.Background())
	done := startAgentStream(agentCtx, cfg)
	defer func() { stopAgent(); <-done }()

	var got *eitriv1.ListHostImagesResponse
	require.Eventually(t, func() bool {
		var err error
		got, err = a.srv.Fleet.ListHostImages(onA, id.HostID)
		return err == nil && len(got.GetImages()) == 1
	}, 10*time.Second, 20*time.Millisecond, "a answers with the listing b's host sent")
	assert.Equal(t, sha, got.GetImages()[0].GetSha256())
	assert.Equal(t, uint64(4<<20), got.GetTotalBytes())
	assert.NotNil(t, got.GetReportedAt(), "when the host said it")

	stopAgent()
	<-done
	require.Eventually(t, func() bool {
		got, err := a.srv.Fleet.ListHostImages(onA, id.HostID)
		return err == nil && len(got.GetImages()) == 0 && got.GetReportedAt() == nil
	}, 10*time.Second, 20*time.Millisecond, "a host that went away holds nothing anyone can vouch for")
}
