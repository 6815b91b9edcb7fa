package api_test

import (
	"context"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
)

// Attacks by one tenant on the others (taking host ports, filling hosts past
// a quota, hearing of removals not theirs), replayed against the real server
// over real HTTP with the generated clients.

func (e *env) quotas(tok string) eitriv1connect.QuotaServiceClient {
	return eitriv1connect.NewQuotaServiceClient(e.http, e.url, bearer(tok))
}

// tenant mints a token for a new non-admin user.
func (e *env) tenant(name string) string {
	e.t.Helper()
	tok, err := e.tokens(e.admin).CreateToken(context.Background(), connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "t", UserName: name}))
	require.NoError(e.t, err)
	return tok.Msg.Secret
}

func (e *env) setQuota(user string, l *eitriv1.QuotaLimits) {
	e.t.Helper()
	_, err := e.quotas(e.admin).SetQuota(context.Background(), connect.NewRequest(&eitriv1.SetQuotaRequest{UserName: user, Limits: l}))
	require.NoError(e.t, err)
}

func (e *env) mustCreateVM(tok string, r *eitriv1.CreateVMRequest) *eitriv1.VM {
	e.t.Helper()
	vm, err := e.vms(tok).CreateVM(context.Background(), connect.NewRequest(r))
	require.NoError(e.t, err)
	return vm.Msg.Vm
}

func expose(e *env, tok, vmID string, port uint32, proto string) (*eitriv1.Exposure, error) {
	r, err := e.exposures(tok).CreateExposure(context.Background(), connect.NewRequest(&eitriv1.CreateExposureRequest{
		VmId: vmID, GuestPort: 80, HostPort: port, Protocol: proto,
	}))
	if err != nil {
		return nil, err
	}
	return r.Msg.Exposure, nil
}

func n64(v int64) *int64 { return &v }

// --- host ports ---

func TestATenantCannotTakeAWellKnownPortOrOneOutsideTheRange(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	alice := e.tenant("alice")
	vm := e.mustCreateVM(alice, createReq("web-1"))
	for _, c := range []struct {
		port  uint32
		proto string
	}{{22, "tcp"}, {25, "tcp"}, {443, "tcp"}, {123, "udp"}, {7443, "tcp"}, {29999, "tcp"}, {32768, "udp"}, {65535, "tcp"}} {
		_, err := expose(e, alice, vm.Id, c.port, c.proto)
		require.Equal(t, connect.CodePermissionDenied, code(err), "%d/%s", c.port, c.proto)
		assert.Contains(t, err.Error(), "host_port:")
		assert.Contains(t, err.Error(), "30000-32767")
	}
	list, err := e.exposures(alice).ListExposures(context.Background(), connect.NewRequest(&eitriv1.ListExposuresRequest{}))
	require.NoError(t, err)
	assert.Empty(t, list.Msg.Exposures, "nothing was bound")

	x, err := expose(e, alice, vm.Id, 30500, "tcp")
	require.NoError(t, err, "a port of the range is the tenant's to choose")
	assert.EqualValues(t, 30500, x.HostPort)
	x, err = expose(e, e.admin, e.mustCreateVM(e.admin, createReq("adm")).Id, 25, "tcp")
	require.NoError(t, err, "an admin may choose a port outside the range")
	assert.EqualValues(t, 25, x.HostPort)
}

// servedEnv is a control plane served by Serve on a real loopback listener
// (h2c), as eitri dev runs it, so it knows the port it listens on; cfg is
// made knowing that port.
func servedEnv(t *testing.T, cfg func(port uint16) server.Config) (*env, uint16) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := uint16(ln.Addr().(*net.TCPAddr).Port)
	c := cfg(port)
	c.DataDir, c.Plaintext = t.TempDir(), true
	s, err := server.New(context.Background(), c)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(ctx, ln) }()
	t.Cleanup(func() { cancel(); <-done; s.Close() })
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	return &env{t: t, srv: s, url: "http://" + ln.Addr().String(), http: &http.Client{Transport: tr}, admin: s.AdminToken, dir: c.DataDir}, port
}

func TestNobodyTakesTheControlPlanesOrTheAgentsOwnPort(t *testing.T) {
	// The listener's port is in the range, so allocation must step over it
	// too; the public URL names another port, which is reserved as well.
	e, port := servedEnv(t, func(port uint16) server.Config {
		return server.Config{PublicURL: "https://cp.example:8443", PortMin: port - 1, PortMax: port + 1}
	})
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	alice := e.tenant("alice")
	avm := e.mustCreateVM(alice, createReq("web-1"))
	vm := e.mustCreateVM(e.admin, createReq("web-1"))

	cases := []struct {
		who   string
		tok   string
		vm    string
		port  uint32
		proto string
		whose string
	}{
		{"admin", e.admin, vm.Id, uint32(port), "tcp", "control plane"},
		{"tenant", alice, avm.Id, uint32(port), "tcp", "control plane"},
		{"admin", e.admin, vm.Id, 8443, "tcp", "control plane"},
		{"admin", e.admin, vm.Id, 67, "udp", "DHCP"},
		{"admin", e.admin, vm.Id, 53, "udp", "DNS forwarder"},
		{"tenant", alice, avm.Id, 53, "tcp", "DNS forwarder"},
		{"admin", e.admin, vm.Id, 7480, "tcp", "phone-home"},
	}
	for _, c := range cases {
		_, err := expose(e, c.tok, c.vm, c.port, c.proto)
		require.Equal(t, connect.CodeInvalidArgument, code(err), "%s %d/%s", c.who, c.port, c.proto)
		assert.Contains(t, err.Error(), "host_port:")
		assert.Contains(t, err.Error(), c.whose)
	}
	var got []uint32
	for range 2 {
		x, err := expose(e, alice, avm.Id, 0, "tcp")
		require.NoError(t, err)
		got = append(got, x.HostPort)
	}
	assert.Equal(t, []uint32{uint32(port) - 1, uint32(port) + 1}, got, "allocation steps over the control plane's port")
	_, err := expose(e, alice, avm.Id, 0, "tcp")
	assert.Equal(t, connect.CodeFailedPrecondition, code(err), "the range is used up")
}

func TestATakenPortDoesNotNameAnotherUsersExposure(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	alice, bob := e.tenant("alice"), e.tenant("bob")
	avm := e.mustCreateVM(alice, createReq("web-1"))
	bvm := e.mustCreateVM(bob, createReq("web-1"))
	held, err := expose(e, alice, avm.Id, 30100, "tcp")
	require.NoError(t, err)

	_, err = expose(e, bob, bvm.Id, 30100, "tcp")
	require.Equal(t, connect.CodeAlreadyExists, code(err))
	assert.Contains(t, err.Error(), "host_port:")
	assert.NotContains(t, err.Error(), held.Id)
	assert.NotContains(t, err.Error(), avm.Id)

	_, err = expose(e, alice, avm.Id, 30100, "tcp")
	require.Equal(t, connect.CodeAlreadyExists, code(err))
	assert.Contains(t, err.Error(), held.Id, "its owner is told which of its exposures holds it")
}

// --- removals reach only their owner ---

// collect reads a stream in the background.
func collect[T any](t *testing.T, st *connect.ServerStreamForClient[T]) <-chan *T {
	t.Helper()
	ch := make(chan *T, 256)
	go func() {
		defer close(ch)
		for st.Receive() {
			ch <- st.Msg()
		}
	}()
	t.Cleanup(func() { st.Close() })
	return ch
}

// until reads ch until done says so, returning everything read.
func until[T any](t *testing.T, ch <-chan *T, done func(*T) bool) []*T {
	t.Helper()
	var seen []*T
	for {
		select {
		case m, ok := <-ch:
			require.True(t, ok, "stream ended")
			seen = append(seen, m)
			if done(m) {
				return seen
			}
		case <-time.After(5 * time.Second):
			t.Fatal("timed out")
		}
	}
}

func TestWatchersDoNotHearOfOtherUsersRemovedIDs(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice, bob := e.tenant("alice"), e.tenant("bob")

	vst, err := e.vms(alice).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	vms := collect(t, vst)
	xst, err := e.exposures(alice).WatchExposures(ctx, connect.NewRequest(&eitriv1.WatchExposuresRequest{}))
	require.NoError(t, err)
	exps := collect(t, xst)
	admin, err := e.vms(e.admin).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	adminVMs := collect(t, admin)

	// Bob publishes and unpublishes a port, then deletes his VM, and the host
	// destroys it for good.
	bvm := e.mustCreateVM(bob, createReq("secret-project"))
	bx, err := expose(e, bob, bvm.Id, 0, "tcp")
	require.NoError(t, err)
	_, err = e.exposures(bob).DeleteExposure(ctx, connect.NewRequest(&eitriv1.DeleteExposureRequest{Id: bx.Id}))
	require.NoError(t, err)
	bx2, err := expose(e, bob, bvm.Id, 0, "udp")
	require.NoError(t, err)
	_, err = e.vms(bob).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: bvm.Id}))
	require.NoError(t, err)
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Destroyed: []string{bvm.Id}})
	until(t, adminVMs, func(m *eitriv1.WatchVMsResponse) bool { return m.GetRemovedId() == bvm.Id })

	// Then alice does something of her own: everything before it on her
	// streams is what she heard of bob's.
	mine := e.mustCreateVM(alice, createReq("mine"))
	x, err := expose(e, alice, mine.Id, 0, "tcp")
	require.NoError(t, err)
	for _, m := range until(t, vms, func(m *eitriv1.WatchVMsResponse) bool { return m.GetChanged().GetId() == mine.Id }) {
		assert.NotEqual(t, bvm.Id, m.GetRemovedId())
		assert.NotEqual(t, bvm.Id, m.GetChanged().GetId())
	}
	for _, m := range until(t, exps, func(m *eitriv1.WatchExposuresResponse) bool { return m.GetChanged().GetId() == x.Id }) {
		assert.NotContains(t, []string{bx.Id, bx2.Id}, m.GetRemovedId())
		assert.NotContains(t, []string{bx.Id, bx2.Id}, m.GetChanged().GetId())
	}
}

// --- quotas ---

func TestOneUserCannotFillEveryHostPastItsQuota(t *testing.T) {
	cases := []struct {
		limit string
		quota *eitriv1.QuotaLimits
		// fill creates what the quota allows; over is the request past it.
		over func(e *env, tok, vmID string) error
	}{
		{"vms", &eitriv1.QuotaLimits{Vms: n64(1)}, func(e *env, tok, _ string) error {
			_, err := e.vms(tok).CreateVM(context.Background(), connect.NewRequest(createReq("two")))
			return err
		}},
		{"vcpus", &eitriv1.QuotaLimits{Vcpus: n64(2)}, func(e *env, tok, _ string) error {
			r := createReq("two")
			r.Vcpus = 2
			_, err := e.vms(tok).CreateVM(context.Background(), connect.NewRequest(r))
			return err
		}},
		{"mem_mb", &eitriv1.QuotaLimits{MemMb: n64(512)}, func(e *env, tok, _ string) error {
			r := createReq("two")
			r.MemMb = 257
			_, err := e.vms(tok).CreateVM(context.Background(), connect.NewRequest(r))
			return err
		}},
		{"disk_gb", &eitriv1.QuotaLimits{DiskGb: n64(3)}, func(e *env, tok, _ string) error {
			_, err := e.vms(tok).CreateVM(context.Background(), connect.NewRequest(createReq("two")))
			return err
		}},
		{"exposures", &eitriv1.QuotaLimits{Exposures: n64(0)}, func(e *env, tok, vmID string) error {
			_, err := expose(e, tok, vmID, 0, "tcp")
			return err
		}},
	}
	for _, c := range cases {
		t.Run(c.limit, func(t *testing.T) {
			e := newEnv(t)
			h, cred := e.enroll("h1")
			e.connect(h, cred, big())
			alice := e.tenant("alice")
			e.setQuota("alice", c.quota)
			vm := e.mustCreateVM(alice, createReq("one"))

			err := c.over(e, alice, vm.Id)
			require.Equal(t, connect.CodeResourceExhausted, code(err))
			assert.Contains(t, err.Error(), "quota: "+c.limit+":")
			q, err := e.quotas(alice).GetQuota(context.Background(), connect.NewRequest(&eitriv1.GetQuotaRequest{}))
			require.NoError(t, err)
			assert.EqualValues(t, 1, q.Msg.Quota.Usage.Vms, "the refused request wrote nothing")
			assert.EqualValues(t, 0, q.Msg.Quota.Usage.Exposures)
		})
	}
}

func TestQuotasAreAdminsToSetAndDefaultsApplyToEveryone(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	alice, bob := e.tenant("alice"), e.tenant("bob")

	_, err := e.quotas(alice).SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{Limits: &eitriv1.QuotaLimits{Vcpus: n64(1000)}}))
	assert.Equal(t, connect.CodePermissionDenied, code(err), "a tenant cannot raise its own quota")
	_, err = e.quotas(alice).SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{Defaults: true, Limits: &eitriv1.QuotaLimits{Vcpus: n64(1000)}}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))
	_, err = e.quotas(alice).GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{UserName: "bob"}))
	assert.Equal(t, connect.CodePermissionDenied, code(err), "nor read another's")

	_, err = e.quotas(e.admin).SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{Defaults: true, Limits: &eitriv1.QuotaLimits{Vcpus: n64(4), Streams: n64(5)}}))
	require.NoError(t, err)
	e.setQuota("alice", &eitriv1.QuotaLimits{Vcpus: n64(16)})
	get := func(tok, user string) *eitriv1.Quota {
		q, err := e.quotas(tok).GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{UserName: user}))
		require.NoError(t, err)
		return q.Msg.Quota
	}
	assert.EqualValues(t, 16, get(alice, "").Effective.GetVcpus(), "its own limit")
	assert.EqualValues(t, 4, get(bob, "").Effective.GetVcpus(), "the default")
	assert.EqualValues(t, 5, get(bob, "").Effective.GetStreams())
	assert.Nil(t, get(bob, "").Own.Vcpus, "bob has no limit of his own")

	_, err = e.quotas(e.admin).SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{UserName: "alice", Unset: []string{"vcpus"}}))
	require.NoError(t, err)
	assert.EqualValues(t, 4, get(e.admin, "alice").Effective.GetVcpus(), "unset follows the default again")

	for _, bad := range []*eitriv1.SetQuotaRequest{
		{UserName: "alice", Limits: &eitriv1.QuotaLimits{Vcpus: n64(-1)}},
		{UserName: "alice", Unset: []string{"gpus"}},
		{UserName: "alice", Defaults: true, Limits: &eitriv1.QuotaLimits{Vms: n64(1)}},
	} {
		_, err := e.quotas(e.admin).SetQuota(ctx, connect.NewRequest(bad))
		assert.Equal(t, connect.CodeInvalidArgument, code(err), "%v", bad)
	}
	_, err = e.quotas(e.admin).SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{UserName: "nobody", Limits: &eitriv1.QuotaLimits{Vms: n64(1)}}))
	assert.Equal(t, connect.CodeNotFound, code(err))
}

func TestOneTokenCannotHoldThousandsOfWatchStreams(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	alice := e.tenant("alice")
	_, err := e.quotas(e.admin).SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{Defaults: true, Limits: &eitriv1.QuotaLimits{Streams: n64(3)}}))
	require.NoError(t, err)

	// Each opens one kind of stream and waits for its first message; the
	// three kinds count together.
	type closer interface{ Close() error }
	first := func(st closer, ok bool, err func() error) (closer, error) {
		t.Cleanup(func() { st.Close() })
		if !ok {
			return nil, err()
		}
		return st, nil
	}
	open := []func() (closer, error){
		func() (closer, error) {
			st, err := e.vms(alice).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
			require.NoError(t, err)
			return first(st, st.Receive(), st.Err)
		},
		func() (closer, error) {
			st, err := e.exposures(alice).WatchExposures(ctx, connect.NewRequest(&eitriv1.WatchExposuresRequest{}))
			require.NoError(t, err)
			return first(st, st.Receive(), st.Err)
		},
		func() (closer, error) {
			st, err := e.hosts(alice).WatchHosts(ctx, connect.NewRequest(&eitriv1.WatchHostsRequest{}))
			require.NoError(t, err)
			return first(st, st.Receive(), st.Err)
		},
	}
	var held []closer
	for _, o := range open {
		st, err := o()
		require.NoError(t, err)
		held = append(held, st)
	}
	for i, o := range open {
		_, err := o()
		require.Equal(t, connect.CodeResourceExhausted, code(err), "stream %d past the cap", i)
		assert.Contains(t, err.Error(), "quota: streams:")
	}
	q, err := e.quotas(alice).GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{}))
	require.NoError(t, err)
	assert.EqualValues(t, 3, q.Msg.Quota.Usage.Streams)

	// Another user is not starved by alice's streams.
	bob := e.tenant("bob")
	st, err := e.vms(bob).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	require.True(t, st.Receive(), "bob's stream opens: %v", st.Err())
	require.NoError(t, st.Close())

	// A closed stream gives its slot back.
	require.NoError(t, held[0].Close())
	require.Eventually(t, func() bool {
		_, err := open[0]()
		return err == nil
	}, 5*time.Second, 20*time.Millisecond)
}

func TestAFailedCreateGivesItsCapacityBack(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, &eitriv1.Capacity{Vcpus: 2, MemMb: 1024, DiskGb: 10})
	alice := e.tenant("alice")
	e.setQuota("alice", &eitriv1.QuotaLimits{Vcpus: n64(2)})
	r := createReq("doomed")
	r.Vcpus = 2
	vm := e.mustCreateVM(alice, r)
	a.next(t)

	r.Name = "next"
	_, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(r))
	require.Equal(t, connect.CodeResourceExhausted, code(err), "quota full while it is creating")

	// The image never arrives; the host gives up on it for good.
	a.report(t, &eitriv1.ActualStateReport{Capacity: &eitriv1.Capacity{Vcpus: 2, MemMb: 1024, DiskGb: 10},
		Vms: []*eitriv1.ActualVM{{VmId: vm.Id, Power: "stopped", Phase: "failed", LastError: "image download stalled"}}})
	require.Eventually(t, func() bool {
		return e.host(h).GetAllocated().GetVcpus() == 0
	}, 5*time.Second, 20*time.Millisecond, "the host's allocation drops")
	assert.EqualValues(t, 0, e.host(h).GetAllocated().GetDiskGb())

	next := e.mustCreateVM(alice, r)
	assert.Equal(t, h, next.HostId, "the host has room again, and so has the quota")
	got, err := e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: vm.Id}))
	require.NoError(t, err)
	assert.Equal(t, "failed", got.Msg.Vm.Lifecycle, "the failed VM stays to be read and deleted")
}

func TestADeletedVMsGuestGivesBackItsCPUsAndARestoreMustFitAgain(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	e.connect(h, cred, &eitriv1.Capacity{Vcpus: 2, MemMb: 1024, DiskGb: 10})
	alice := e.tenant("alice")
	r := createReq("first")
	r.Vcpus = 2
	first := e.mustCreateVM(alice, r)
	_, err := e.vms(alice).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: first.Id}))
	require.NoError(t, err)
	assert.EqualValues(t, 0, e.host(h).GetAllocated().GetVcpus())
	assert.EqualValues(t, 2, e.host(h).GetAllocated().GetDiskGb(), "its disk is kept for a restore")

	r.Name = "second"
	e.mustCreateVM(alice, r)
	_, err = e.vms(alice).RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: first.Id}))
	require.Equal(t, connect.CodeFailedPrecondition, code(err), "a restore cannot overcommit its host")
	assert.Contains(t, err.Error(), "vCPUs free")

	// Nor go past the owner's quota.
	e.setQuota("alice", &eitriv1.QuotaLimits{Vms: n64(1)})
	_, err = e.vms(alice).RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: first.Id}))
	require.Equal(t, connect.CodeResourceExhausted, code(err))
}

func TestOversizedFreeTextIsRefusedNamingTheField(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	alice := e.tenant("alice")
	vm := e.mustCreateVM(alice, createReq("web-1"))
	long := func(n int) string { return strings.Repeat("a", n) }
	key := "ssh-ed25519 AAAA" + long(9<<10)

	cases := []struct {
		field string
		call  func() error
	}{
		{"ssh_authorized_key", func() error {
			r := createReq("k")
			r.SshAuthorizedKey = key
			_, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(r))
			return err
		}},
		{"name", func() error {
			_, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(createReq(long(10_000))))
			return err
		}},
		{"image_url", func() error {
			r := createReq("u")
			r.ImageUrl = "http://images.test/" + long(3000)
			_, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(r))
			return err
		}},
		{"host_id", func() error {
			r := createReq("h")
			r.HostId = long(1000)
			_, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(r))
			return err
		}},
		{"power_state", func() error {
			r := createReq("p")
			r.PowerState = long(1000)
			_, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(r))
			return err
		}},
		{"id", func() error {
			_, err := e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: long(10_000)}))
			return err
		}},
		{"id", func() error {
			_, err := e.exposures(alice).DeleteExposure(ctx, connect.NewRequest(&eitriv1.DeleteExposureRequest{Id: long(10_000)}))
			return err
		}},
		{"protocol", func() error {
			_, err := expose(e, alice, vm.Id, 0, long(10_000))
			return err
		}},
		{"name", func() error {
			_, err := e.tokens(alice).CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: long(10_000)}))
			return err
		}},
		{"user_name", func() error {
			_, err := e.quotas(alice).GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{UserName: long(10_000)}))
			return err
		}},
		{"hostname", func() error {
			jt, err := e.hosts(e.admin).CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
			require.NoError(t, err)
			_, err = eitriv1connect.NewAgentServiceClient(e.http, e.url).Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: jt.Msg.Token, Hostname: long(10_000)}))
			return err
		}},
	}
	for i, c := range cases {
		err := c.call()
		require.Equal(t, connect.CodeInvalidArgument, code(err), "case %d (%s)", i, c.field)
		var ce *connect.Error
		require.ErrorAs(t, err, &ce)
		assert.True(t, strings.HasPrefix(ce.Message(), c.field+":"), "case %d: %s", i, ce.Message())
		assert.Less(t, len(ce.Message()), 300, "case %d: the error does not echo the value", i)
	}

	// The attack as found: a 5 MiB key. Whichever layer refuses it, nothing
	// is stored.
	r := createReq("huge")
	r.SshAuthorizedKey = "ssh-ed25519 " + long(5<<20)
	_, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(r))
	require.Error(t, err)
	list, err := e.vms(alice).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Vms, 1, "only the first VM exists")
	hosts, err := e.hosts(e.admin).ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
	require.NoError(t, err)
	assert.Len(t, hosts.Msg.Hosts, 1, "no host was enrolled under a huge name")
}
