package api_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/connclient"
)

const sha = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"

type env struct {
	t     *testing.T
	srv   *server.Server
	url   string
	http  *http.Client
	admin string
	dir   string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	ctx := context.Background()
	s, err := server.New(ctx, server.Config{DataDir: dir, Plaintext: true, DeleteGrace: time.Hour})
	require.NoError(t, err)
	ts := httptest.NewUnstartedServer(s.Handler())
	ts.EnableHTTP2 = true
	ts.StartTLS()
	t.Cleanup(func() { ts.Close(); s.Close() })
	return &env{t: t, srv: s, url: ts.URL, http: ts.Client(), admin: s.AdminToken, dir: dir}
}

func bearer(tok string) connect.ClientOption {
	return connect.WithInterceptors(connclient.Bearer(tok))
}

func (e *env) vms(tok string) eitriv1connect.VMServiceClient {
	return eitriv1connect.NewVMServiceClient(e.http, e.url, bearer(tok))
}
func (e *env) hosts(tok string) eitriv1connect.HostServiceClient {
	return eitriv1connect.NewHostServiceClient(e.http, e.url, bearer(tok))
}
func (e *env) exposures(tok string) eitriv1connect.ExposureServiceClient {
	return eitriv1connect.NewExposureServiceClient(e.http, e.url, bearer(tok))
}
func (e *env) tokens(tok string) eitriv1connect.TokenServiceClient {
	return eitriv1connect.NewTokenServiceClient(e.http, e.url, bearer(tok))
}

// agent is a real AgentService client driving the protocol by hand.
type agent struct {
	hostID string
	stream *connect.BidiStreamForClient[eitriv1.SyncRequest, eitriv1.SyncResponse]
	snaps  chan *eitriv1.DesiredStateSnapshot
	ended  chan error // the stream's final error, once it ends
}

func (e *env) enroll(name string) (string, string) {
	e.t.Helper()
	jt, err := e.hosts(e.admin).CreateJoinToken(context.Background(), connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	require.NoError(e.t, err)
	assert.Contains(e.t, jt.Msg.Command, jt.Msg.Token)
	ac := eitriv1connect.NewAgentServiceClient(e.http, e.url)
	resp, err := ac.Enroll(context.Background(), connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: jt.Msg.Token, Hostname: name}))
	require.NoError(e.t, err)
	return resp.Msg.HostId, resp.Msg.HostCredential
}

func (e *env) connect(hostID, cred string, capacity *eitriv1.Capacity) *agent {
	e.t.Helper()
	return e.connectWith(hostID, cred, capacity, &eitriv1.Hello{AgentVersion: "test", Address: "192.0.2.10", Accelerator: "tcg"})
}

// open starts a Sync stream and sends hello, without waiting for anything.
func (e *env) open(hostID, cred string, hello *eitriv1.Hello) *agent {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	ac := eitriv1connect.NewAgentServiceClient(e.http, e.url, bearer(cred))
	st := ac.Sync(ctx)
	e.t.Cleanup(func() {
		cancel()
		_ = st.CloseRequest()
		_ = st.CloseResponse()
	})
	require.NoError(e.t, st.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: hello}}))
	a := &agent{hostID: hostID, stream: st, snaps: make(chan *eitriv1.DesiredStateSnapshot, 64), ended: make(chan error, 1)}
	go func() {
		for {
			msg, err := st.Receive()
			if err != nil {
				a.ended <- err
				close(a.snaps)
				return
			}
			a.snaps <- msg.GetSnapshot()
		}
	}()
	return a
}

// connectWith opens a stream with hello and waits until its first report
// has landed.
func (e *env) connectWith(hostID, cred string, capacity *eitriv1.Capacity, hello *eitriv1.Hello) *agent {
	e.t.Helper()
	a := e.open(hostID, cred, hello)
	first := a.next(e.t)
	assert.Empty(e.t, first.GetVms())
	a.report(e.t, &eitriv1.ActualStateReport{Capacity: capacity})
	require.Eventually(e.t, func() bool {
		h, err := e.hosts(e.admin).GetHost(context.Background(), connect.NewRequest(&eitriv1.GetHostRequest{Id: hostID}))
		return err == nil && h.Msg.Host.Connected && proto.Equal(h.Msg.Host.Capacity, capacity)
	}, 5*time.Second, 5*time.Millisecond, "the first report lands")
	return a
}

func (a *agent) next(t *testing.T) *eitriv1.DesiredStateSnapshot {
	t.Helper()
	select {
	case s, ok := <-a.snaps:
		require.True(t, ok, "stream closed")
		return s
	case <-time.After(5 * time.Second):
		t.Fatal("no snapshot")
		return nil
	}
}

func (a *agent) report(t *testing.T, rep *eitriv1.ActualStateReport) {
	t.Helper()
	require.NoError(t, a.stream.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Report{Report: rep}}))
}

func big() *eitriv1.Capacity { return &eitriv1.Capacity{Vcpus: 8, MemMb: 16384, DiskGb: 200} }

func createReq(name string) *eitriv1.CreateVMRequest {
	return &eitriv1.CreateVMRequest{Name: name, ImageUrl: "http://images.test/guest.raw", ImageSha256: sha, Vcpus: 1, MemMb: 256, DiskGb: 2}
}

func code(err error) connect.Code { return connect.CodeOf(err) }

func TestFirstStartWritesAnAdminTokenOnlyItsOwnerCanRead(t *testing.T) {
	e := newEnv(t)
	require.NotEmpty(t, e.admin)
	fi, err := os.Stat(filepath.Join(e.dir, "admin.token"))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())
	b, _ := os.ReadFile(filepath.Join(e.dir, "admin.token"))
	assert.Equal(t, e.admin, strings.TrimSpace(string(b)))

	// A second start on the same data keeps the admin and makes no new one.
	s2, err := server.New(context.Background(), server.Config{DataDir: e.dir, Plaintext: true})
	require.NoError(t, err)
	defer s2.Close()
	assert.Empty(t, s2.AdminToken)
}

func TestCallsWithoutAValidTokenAreUnauthenticated(t *testing.T) {
	e := newEnv(t)
	for _, tok := range []string{"", "eitri_pat_nope"} {
		_, err := e.vms(tok).ListVMs(context.Background(), connect.NewRequest(&eitriv1.ListVMsRequest{}))
		assert.Equal(t, connect.CodeUnauthenticated, code(err), "token %q", tok)
	}
}

func TestBadVMInputNamesTheFieldAndWritesNothing(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	cases := []struct {
		field string
		mut   func(*eitriv1.CreateVMRequest)
	}{
		{"name", func(r *eitriv1.CreateVMRequest) { r.Name = "Web_1" }},
		{"name", func(r *eitriv1.CreateVMRequest) { r.Name = "" }},
		{"image_url", func(r *eitriv1.CreateVMRequest) { r.ImageUrl = "ftp://x/y" }},
		{"image_sha256", func(r *eitriv1.CreateVMRequest) { r.ImageSha256 = strings.ToUpper(sha) }},
		{"image_sha256", func(r *eitriv1.CreateVMRequest) { r.ImageSha256 = sha[:63] }},
		{"vcpus", func(r *eitriv1.CreateVMRequest) { r.Vcpus = 0 }},
		{"mem_mb", func(r *eitriv1.CreateVMRequest) { r.MemMb = 1 }},
		{"disk_gb", func(r *eitriv1.CreateVMRequest) { r.DiskGb = 0 }},
		{"power_state", func(r *eitriv1.CreateVMRequest) { r.PowerState = "on" }},
		{"host_id", func(r *eitriv1.CreateVMRequest) { r.HostId = "h-nope" }},
	}
	for _, c := range cases {
		r := createReq("web-1")
		c.mut(r)
		_, err := e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(r))
		require.Equal(t, connect.CodeInvalidArgument, code(err), c.field)
		assert.Contains(t, err.Error(), c.field+":")
	}
	list, err := e.vms(e.admin).ListVMs(context.Background(), connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
	assert.Empty(t, list.Msg.Vms)
}

func TestPlacementNeedsACapableConnectedHost(t *testing.T) {
	e := newEnv(t)
	_, err := e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(createReq("web-1")))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))

	small, cred := e.enroll("small")
	e.connect(small, cred, &eitriv1.Capacity{Vcpus: 1, MemMb: 512, DiskGb: 10})
	large, cred2 := e.enroll("large")
	e.connect(large, cred2, big())
	vm, err := e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	assert.Equal(t, large, vm.Msg.Vm.HostId, "the host with the most free capacity")

	r := createReq("web-2")
	r.HostId, r.MemMb = small, 1024
	_, err = e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(r))
	require.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "MiB memory free")

	_, err = e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(createReq("web-1")))
	assert.Equal(t, connect.CodeAlreadyExists, code(err), "names are unique per owner")
}

func TestAVMLivesThroughItsHostsReports(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())

	watch, err := e.vms(e.admin).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	defer watch.Close()
	require.True(t, watch.Receive())
	require.NotNil(t, watch.Msg().GetSnapshot(), "a watch starts with the full list")
	assert.Empty(t, watch.Msg().GetSnapshot().GetVms())

	created, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	id := created.Msg.Vm.Id
	assert.Equal(t, "pending", created.Msg.Vm.Lifecycle)

	snap := a.next(t)
	require.Len(t, snap.Vms, 1)
	assert.Equal(t, id, snap.Vms[0].VmId)
	assert.Equal(t, "running", snap.Vms[0].PowerState)

	nextVM := func() *eitriv1.VM {
		t.Helper()
		require.True(t, watch.Receive(), "watch ended: %v", watch.Err())
		return watch.Msg().GetChanged()
	}
	assert.Equal(t, "pending", nextVM().GetLifecycle())

	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{{VmId: id, Power: "stopped", Phase: "creating", StatusDetail: "downloading image 1.2/3.7 GiB"}}})
	v := nextVM()
	assert.Equal(t, "creating", v.Lifecycle)
	assert.Equal(t, "downloading image 1.2/3.7 GiB", v.StatusDetail, "narration reaches the watcher without asking")

	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{{VmId: id, Power: "running", Phase: "ready", Ip: "10.77.0.5", SshHostPubkey: "ssh-ed25519 AAAA", LoginUser: "eitri", ReadySignal: "cloud-init"}}})
	v = nextVM()
	assert.Equal(t, "ready", v.Lifecycle)
	assert.Equal(t, "10.77.0.5", v.AssignedIp)
	assert.Equal(t, "eitri", v.LoginUser, "the host's login user reaches the API")
	assert.Equal(t, "cloud-init", v.ReadySignal, "and what made the guest ready")
	assert.Empty(t, v.StatusDetail)

	_, err = e.vms(e.admin).StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: id}))
	require.NoError(t, err)
	assert.Equal(t, "stopped", a.next(t).Vms[0].PowerState)

	del, err := e.vms(e.admin).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
	require.NoError(t, err)
	assert.Equal(t, "deleting", del.Msg.Vm.Lifecycle)
	require.NotNil(t, del.Msg.Vm.DestroyAt)
	snap = a.next(t)
	assert.True(t, snap.Vms[0].Deleted)

	_, err = e.vms(e.admin).RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: id}))
	require.NoError(t, err)
	assert.False(t, a.next(t).Vms[0].Deleted)
	_, err = e.vms(e.admin).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
	require.NoError(t, err)
	a.next(t)

	// The host destroys it for good: the VM is gone and the watcher is told.
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Destroyed: []string{id}})
	require.Eventually(t, func() bool {
		_, err := e.vms(e.admin).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		return code(err) == connect.CodeNotFound
	}, 5*time.Second, 20*time.Millisecond)
	removed := false
	for !removed && watch.Receive() {
		removed = watch.Msg().GetRemovedId() == id
	}
	assert.True(t, removed)

	_, err = e.vms(e.admin).ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: id}))
	assert.Equal(t, connect.CodeNotFound, code(err), "a destroyed VM's timeline goes with it")
}

func TestAUserSeesOnlyItsOwnVMs(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	adminVM, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)

	tok, err := e.tokens(e.admin).CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "ci", UserName: "alice"}))
	require.NoError(t, err)
	alice := tok.Msg.Secret

	_, err = e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: adminVM.Msg.Vm.Id}))
	assert.Equal(t, connect.CodeNotFound, code(err), "another user's VM does not exist for you")
	_, err = e.vms(alice).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: adminVM.Msg.Vm.Id}))
	assert.Equal(t, connect.CodeNotFound, code(err))

	own, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err, "names are unique per owner, not globally")
	list, err := e.vms(alice).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Vms, 1)
	assert.Equal(t, own.Msg.Vm.Id, list.Msg.Vms[0].Id)
	all, err := e.vms(e.admin).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
	assert.Len(t, all.Msg.Vms, 2, "an admin sees all")

	_, err = e.hosts(alice).CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))
	_, err = e.tokens(alice).CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "x", UserName: "bob"}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))

	// Revoked means revoked, at once.
	_, err = e.tokens(e.admin).RevokeToken(ctx, connect.NewRequest(&eitriv1.RevokeTokenRequest{Id: tok.Msg.Token.Id}))
	require.NoError(t, err)
	_, err = e.vms(alice).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	assert.Equal(t, connect.CodeUnauthenticated, code(err))
}

func TestJoinTokensAreSingleUse(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	jt, err := e.hosts(e.admin).CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	require.NoError(t, err)
	ac := eitriv1connect.NewAgentServiceClient(e.http, e.url)
	_, err = ac.Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: jt.Msg.Token, Hostname: "a"}))
	require.NoError(t, err)
	_, err = ac.Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: jt.Msg.Token, Hostname: "b"}))
	assert.Equal(t, connect.CodeUnauthenticated, code(err))
	assert.Contains(t, err.Error(), "already used")
	_, err = ac.Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: "garbage", Hostname: "c"}))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))

	// A user token does not open the agent stream.
	st := eitriv1connect.NewAgentServiceClient(e.http, e.url, bearer(e.admin)).Sync(ctx)
	_ = st.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: &eitriv1.Hello{}}})
	_, err = st.Receive()
	assert.Equal(t, connect.CodeUnauthenticated, code(err))
}

func TestASecondStreamReplacesTheFirst(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	first := e.connect(h, cred, big())
	second := e.connect(h, cred, big())
	var err error
	select {
	case err = <-first.ended:
	case <-time.After(5 * time.Second):
		t.Fatal("the replaced stream was not ended")
	}
	assert.Equal(t, connect.CodeAborted, code(err))
	assert.Contains(t, err.Error(), "replaced")
	_, err = e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	assert.Len(t, second.next(t).Vms, 1, "the newer stream keeps receiving")
}

// postJSON is curl: the Connect protocol with plain JSON.
func (e *env) postJSON(procedure string, body any) (int, map[string]any) {
	e.t.Helper()
	b, _ := json.Marshal(body)
	var out map[string]any
	status := e.post(procedure, b, &out)
	return status, out
}

// post sends body as typed, as the admin, and decodes the JSON answer into
// out; it returns the HTTP status.
func (e *env) post(procedure string, body []byte, out any) int {
	e.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, e.url+procedure, bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+e.admin)
	resp, err := e.http.Do(req)
	require.NoError(e.t, err)
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	require.NoError(e.t, json.Unmarshal(raw, out), string(raw))
	return resp.StatusCode
}

func TestJSONShowsEveryFieldAndNullForWhatNobodyReported(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	status, out := e.postJSON("/eitri.v1.VMService/CreateVM", map[string]any{
		"name": "web-1", "image_url": "http://images.test/g.raw", "image_sha256": sha, "vcpus": 1, "mem_mb": 256, "disk_gb": 2,
	})
	require.Equal(t, 200, status, out)
	vm := out["vm"].(map[string]any)
	for _, f := range []string{"id", "name", "host_id", "image_url", "image_sha256", "vcpus", "mem_mb", "disk_gb", "power_state", "status", "last_error", "assigned_ip", "created_at", "deleted", "actual_power", "phase", "status_detail", "destroy_at", "lifecycle"} {
		assert.Contains(t, vm, f)
	}
	assert.Nil(t, vm["destroy_at"])
	assert.Equal(t, "running", vm["power_state"])
	a.next(t)

	status, out = e.postJSON("/eitri.v1.ExposureService/CreateExposure", map[string]any{"vm_id": vm["id"], "guest_port": 80, "host_port": 30080})
	require.Equal(t, 200, status, out)
	x := out["exposure"].(map[string]any)
	assert.Equal(t, "pending", x["state"])
	assert.Contains(t, x, "sessions")
	assert.Nil(t, x["sessions"], "an exposure nobody reported on has no counters, not zeros")
	assert.Equal(t, "tcp", x["protocol"])
	assert.Equal(t, "lan", x["scope"])
	assert.Equal(t, "192.0.2.10", x["host_addr"])
	snap := a.next(t)
	require.Len(t, snap.Exposures, 1)

	// Port taken: AlreadyExists naming the holder; nothing written.
	status, out = e.postJSON("/eitri.v1.ExposureService/CreateExposure", map[string]any{"vm_id": vm["id"], "guest_port": 81, "host_port": 30080})
	assert.Equal(t, 409, status)
	assert.Equal(t, "already_exists", out["code"])
	assert.Contains(t, out["message"], x["id"])
	for _, bad := range []map[string]any{
		{"vm_id": vm["id"], "guest_port": 0},
		{"vm_id": vm["id"], "guest_port": 70000},
		{"vm_id": vm["id"], "guest_port": 80, "protocol": "sctp"},
		{"vm_id": vm["id"], "guest_port": 80, "scope": "world"},
	} {
		status, out = e.postJSON("/eitri.v1.ExposureService/CreateExposure", bad)
		assert.Equal(t, 400, status, bad)
		assert.Equal(t, "invalid_argument", out["code"])
	}
	_, out = e.postJSON("/eitri.v1.ExposureService/ListExposures", map[string]any{"vm_id": vm["id"]})
	require.Len(t, out["exposures"], 1, "refused creates wrote nothing")

	// An old agent's report: state, no counters → still null. A counting
	// agent's report: the counters, as reported.
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Exposures: []*eitriv1.ExposureActual{{Id: x["id"].(string), State: "active"}}})
	require.Eventually(t, func() bool {
		_, out = e.postJSON("/eitri.v1.ExposureService/ListExposures", map[string]any{})
		return out["exposures"].([]any)[0].(map[string]any)["state"] == "active"
	}, 5*time.Second, 20*time.Millisecond)
	assert.Nil(t, out["exposures"].([]any)[0].(map[string]any)["sessions"])

	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Exposures: []*eitriv1.ExposureActual{{Id: x["id"].(string), State: "active", Sessions: &eitriv1.ExposureSessions{Active: 7, Refused: 12, Dropped: 3}}}})
	require.Eventually(t, func() bool {
		_, out = e.postJSON("/eitri.v1.ExposureService/ListExposures", map[string]any{})
		return out["exposures"].([]any)[0].(map[string]any)["sessions"] != nil
	}, 5*time.Second, 20*time.Millisecond)
	s := out["exposures"].([]any)[0].(map[string]any)["sessions"].(map[string]any)
	assert.Equal(t, map[string]any{"active": "7", "refused": "12", "dropped": "3", "carried": nil}, s,
		"an agent that counts sessions but not bytes: the bytes are null, not 0")

	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Exposures: []*eitriv1.ExposureActual{{Id: x["id"].(string), State: "active",
		Sessions: &eitriv1.ExposureSessions{Active: 7, Refused: 12, Dropped: 3, Carried: &eitriv1.ExposureBytes{In: 0, Out: 1 << 40}}}}})
	require.Eventually(t, func() bool {
		_, out = e.postJSON("/eitri.v1.ExposureService/ListExposures", map[string]any{})
		return out["exposures"].([]any)[0].(map[string]any)["sessions"].(map[string]any)["carried"] != nil
	}, 5*time.Second, 20*time.Millisecond)
	c := out["exposures"].([]any)[0].(map[string]any)["sessions"].(map[string]any)["carried"]
	assert.Equal(t, map[string]any{"in": "0", "out": "1099511627776"}, c, "a counted zero is a zero")
}

func TestTheConsoleLogsInWithACookieAndLogoutRevokesIt(t *testing.T) {
	e := newEnv(t)
	post := func(path, body string, cookie *http.Cookie) *http.Response {
		req, _ := http.NewRequest(http.MethodPost, e.url+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if cookie != nil {
			req.AddCookie(cookie)
		}
		resp, err := e.http.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp
	}
	assert.Equal(t, http.StatusUnauthorized, post("/auth/login", `{"token":"eitri_pat_wrong"}`, nil).StatusCode)
	resp := post("/auth/login", `{"token":"`+e.admin+`"}`, nil)
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	var cookie *http.Cookie
	for _, c := range resp.Cookies() {
		if c.Name == "__Host-eitri_session" { // over TLS
			cookie = c
		}
	}
	require.NotNil(t, cookie)
	assert.True(t, cookie.HttpOnly)
	assert.Equal(t, http.SameSiteStrictMode, cookie.SameSite)
	assert.NotEqual(t, e.admin, cookie.Value, "the cookie is its own credential, not the pasted token")

	listWithCookie := func() error {
		c := eitriv1connect.NewVMServiceClient(e.http, e.url, connect.WithInterceptors(connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
			return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
				req.Header().Set("Cookie", cookie.Name+"="+cookie.Value)
				return next(ctx, req)
			}
		})))
		_, err := c.ListVMs(context.Background(), connect.NewRequest(&eitriv1.ListVMsRequest{}))
		return err
	}
	require.NoError(t, listWithCookie())
	assert.Equal(t, http.StatusNoContent, post("/auth/logout", `{}`, cookie).StatusCode)
	assert.Equal(t, connect.CodeUnauthenticated, code(listWithCookie()), "logout revokes the session")
}

func TestAnUnsetHostPortIsAllocatedFromTheRange(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	vm, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	var ports []uint32
	for _, proto := range []string{"tcp", "tcp", "udp"} {
		x, err := e.exposures(e.admin).CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{VmId: vm.Msg.Vm.Id, GuestPort: 80, Protocol: proto}))
		require.NoError(t, err)
		ports = append(ports, x.Msg.Exposure.HostPort)
	}
	assert.Equal(t, []uint32{30000, 30001, 30000}, ports, "the lowest free port of the range, per protocol")
}

func TestTheMCPEndpointIsServedAndNeedsAToken(t *testing.T) {
	e := newEnv(t)
	req, _ := http.NewRequest(http.MethodPost, e.url+"/mcp", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"tools/list"}`))
	req.Header.Set("Content-Type", "application/json")
	resp, err := e.http.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusUnauthorized, resp.StatusCode)
}
