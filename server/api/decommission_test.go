package api_test

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

func (e *env) decommission(id string, force bool) (*eitriv1.DecommissionHostResponse, error) {
	r, err := e.hosts(e.admin).DecommissionHost(context.Background(), connect.NewRequest(&eitriv1.DecommissionHostRequest{Id: id, Force: force}))
	if err != nil {
		return nil, err
	}
	return r.Msg, nil
}

func TestADeadHostCanBeDecommissionedByForceAndItsVMsStayAsLostRows(t *testing.T) {
	e, clk := newClockedEnv(t)
	ctx := context.Background()
	dead, cred := e.enroll("dead")
	a := e.connect(dead, cred, big())
	alice := e.tenant("alice")
	r := createReq("web")
	r.HostId = dead
	web := e.mustCreateVM(alice, r)
	r.Name = "old"
	old := e.mustCreateVM(alice, r)
	_, err := e.vms(alice).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: old.Id}))
	require.NoError(t, err)
	x, err := expose(e, alice, web.Id, 0, "tcp")
	require.NoError(t, err)

	// The machine dies: its stream ends and never comes back.
	require.NoError(t, a.stream.CloseRequest())
	require.Eventually(t, func() bool { return !e.host(dead).GetConnected() }, 5*time.Second, 10*time.Millisecond)

	_, err = e.decommission(dead, false)
	require.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "with force", "the refusal names the way out for a dead host")

	_, err = e.decommission(dead, true)
	require.Equal(t, connect.CodeFailedPrecondition, code(err), "just disconnected is not dead")
	assert.Contains(t, err.Error(), "try again in 10m0s")
	clk.Advance(9 * time.Minute)
	_, err = e.decommission(dead, true)
	require.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "last seen 9m0s ago")
	assert.Contains(t, err.Error(), "try again in 1m0s")

	watch, err := e.vms(alice).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	defer watch.Close()
	require.True(t, watch.Receive())

	clk.Advance(time.Minute)
	resp, err := e.decommission(dead, true)
	require.NoError(t, err)
	assert.Equal(t, []string{web.Id}, resp.GetLostVmIds())
	assert.Equal(t, []string{old.Id}, resp.GetForgottenVmIds())

	got, err := e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: web.Id}))
	require.NoError(t, err, "a lost VM is kept as a row")
	vm := got.Msg.Vm
	assert.Equal(t, "lost", vm.GetLifecycle())
	assert.Equal(t, "lost", vm.GetStatus())
	assert.Empty(t, vm.GetHostId())
	assert.Contains(t, vm.GetLastError(), "decommissioned by force")
	assert.Contains(t, vm.GetLastError(), "dead")
	assert.Equal(t, "web", vm.GetName())

	// The owner's watch hears both, as they happen.
	seen := map[string]string{}
	for len(seen) < 2 && watch.Receive() {
		if c := watch.Msg().GetChanged(); c != nil {
			seen[c.GetId()] = c.GetLifecycle()
		}
		if id := watch.Msg().GetRemovedId(); id != "" {
			seen[id] = "removed"
		}
	}
	assert.Equal(t, map[string]string{web.Id: "lost", old.Id: "removed"}, seen)

	_, err = e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: old.Id}))
	assert.Equal(t, connect.CodeNotFound, code(err), "a deleted VM on a dead host can never be destroyed; it is gone")
	_, err = e.hosts(e.admin).GetHost(ctx, connect.NewRequest(&eitriv1.GetHostRequest{Id: dead}))
	assert.Equal(t, connect.CodeNotFound, code(err))
	exps, err := e.exposures(alice).ListExposures(ctx, connect.NewRequest(&eitriv1.ListExposuresRequest{}))
	require.NoError(t, err)
	assert.Empty(t, exps.Msg.Exposures, "exposure %s went with its host", x.Id)
	events, err := e.vms(alice).ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: web.Id}))
	require.NoError(t, err)
	assert.Equal(t, "lost", events.Msg.Events[len(events.Msg.Events)-1].GetKind())

	// Its credential is dead too, should the machine ever come back.
	back := eitriv1connect.NewAgentServiceClient(e.http, e.url, bearer(cred)).Sync(ctx)
	_ = back.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: &eitriv1.Hello{AgentVersion: "test"}}})
	_, err = back.Receive()
	assert.Equal(t, connect.CodeUnauthenticated, code(err), "%v", err)
	_ = back.CloseResponse()

	// Nothing can be done to a lost VM but reading and deleting it.
	_, err = e.vms(alice).StartVM(ctx, connect.NewRequest(&eitriv1.StartVMRequest{Id: web.Id}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
	_, err = expose(e, alice, web.Id, 0, "tcp")
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
	_, err = e.vms(alice).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: web.Id}))
	require.NoError(t, err)
	_, err = e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: web.Id}))
	assert.Equal(t, connect.CodeNotFound, code(err), "deleting a lost VM does not wait for a host that is gone")
}

func TestALostVMHoldsNoQuotaAndItsNameIsFreeOnceDeleted(t *testing.T) {
	e, clk := newClockedEnv(t)
	ctx := context.Background()
	dead, cred := e.enroll("dead")
	a := e.connect(dead, cred, big())
	alive, cred2 := e.enroll("alive")
	e.connect(alive, cred2, big())
	alice := e.tenant("alice")
	e.setQuota("alice", &eitriv1.QuotaLimits{Vms: n64(1)})
	r := createReq("web")
	r.HostId = dead
	web := e.mustCreateVM(alice, r)
	require.NoError(t, a.stream.CloseRequest())
	require.Eventually(t, func() bool { return !e.host(dead).GetConnected() }, 5*time.Second, 10*time.Millisecond)
	clk.Advance(11 * time.Minute)
	_, err := e.decommission(dead, true)
	require.NoError(t, err)

	r.Name, r.HostId = "web-2", ""
	e.mustCreateVM(alice, r) // a lost VM runs nowhere: it does not count

	r.Name = "web"
	_, err = e.vms(alice).CreateVM(ctx, connect.NewRequest(r))
	require.Error(t, err, "the lost row keeps its name until it is deleted")
	_, err = e.vms(alice).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: web.Id}))
	require.NoError(t, err)
	e.setQuota("alice", &eitriv1.QuotaLimits{Vms: n64(2)})
	e.mustCreateVM(alice, r)
}

func TestForceIsRefusedForAConnectedHost(t *testing.T) {
	e, clk := newClockedEnv(t)
	h, cred := e.enroll("busy")
	e.connect(h, cred, big())
	e.mustCreateVM(e.admin, createReq("web"))
	clk.Advance(time.Hour) // however long ago it enrolled
	_, err := e.decommission(h, true)
	require.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "is connected")
	assert.True(t, e.host(h).GetConnected())
	list, err := e.vms(e.admin).ListVMs(context.Background(), connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
	require.Len(t, list.Msg.Vms, 1)
	assert.NotEqual(t, "lost", list.Msg.Vms[0].GetLifecycle())
}

func TestForceNeedsAnAdmin(t *testing.T) {
	e, clk := newClockedEnv(t)
	h, _ := e.enroll("dead")
	clk.Advance(time.Hour)
	alice := e.tenant("alice")
	_, err := e.hosts(alice).DecommissionHost(context.Background(), connect.NewRequest(&eitriv1.DecommissionHostRequest{Id: h, Force: true}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))
	assert.NotNil(t, e.host(h))
}
