package api_test

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

func (e *env) usage(tok string) eitriv1connect.UsageServiceClient {
	return eitriv1connect.NewUsageServiceClient(e.http, e.url, bearer(tok))
}

func (a *agent) sample(t *testing.T, u *eitriv1.UsageSample) {
	t.Helper()
	require.NoError(t, a.stream.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Usage{Usage: u}}))
}

func vmUse(id string, cpu float64) *eitriv1.VMUsage {
	return &eitriv1.VMUsage{VmId: id, At: timestamppb.Now(), CpuSeconds: proto.Float64(cpu), MemoryRssBytes: proto.Uint64(200 << 20),
		Net: &eitriv1.NetUsage{ReceivedBytes: 10, SentBytes: 20}}
}

// usageFleet is a host with alice's and bob's VMs running on it, reported.
func usageFleet(t *testing.T) (e *env, a *agent, hostID, alice, bob string, alices, bobs *eitriv1.VM) {
	e = newEnv(t)
	h, cred := e.enroll("h1")
	a = e.connect(h, cred, big())
	alice, bob = e.tenant("alice"), e.tenant("bob")
	alices = e.mustCreateVM(alice, createReq("alices"))
	bobs = e.mustCreateVM(bob, createReq("bobs"))
	running := func(id string) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: id, Power: "running", Phase: "ready"}
	}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{running(alices.Id), running(bobs.Id)}})
	require.Eventually(t, func() bool {
		v, err := e.vms(e.admin).GetVM(context.Background(), connect.NewRequest(&eitriv1.GetVMRequest{Id: bobs.Id}))
		return err == nil && v.Msg.Vm.GetActualPower() == "running"
	}, 5*time.Second, 5*time.Millisecond)
	return e, a, h, alice, bob, alices, bobs
}

func TestUsageStreamsTheWindowThenEachSampleToWhoMaySeeIt(t *testing.T) {
	e, a, hostID, alice, _, alices, bobs := usageFleet(t)
	ctx := context.Background()

	adminSt, err := e.usage(e.admin).WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{}))
	require.NoError(t, err)
	admin := collect(t, adminSt)
	assert.Empty(t, (<-admin).GetWindow().GetVms(), "nothing measured yet")

	// The host measures itself and both guests, and claims a VM it does
	// not hold: that one is dropped.
	a.sample(t, &eitriv1.UsageSample{
		Host: &eitriv1.HostUsage{HostId: "someone-else", At: timestamppb.Now(), Cpus: 2, CpuBusySeconds: proto.Float64(50)},
		Vms:  []*eitriv1.VMUsage{vmUse(alices.Id, 1.5), vmUse(bobs.Id, 7), vmUse("vm-not-here", 9)},
	})
	heard := map[string]bool{}
	until(t, admin, func(m *eitriv1.WatchUsageResponse) bool {
		if v := m.GetVm(); v != nil {
			heard[v.GetVmId()] = true
			assert.Equal(t, hostID, v.GetHostId(), "the control plane says which host measured it")
		}
		if h := m.GetHost(); h != nil {
			heard["host"] = true
			assert.Equal(t, hostID, h.GetHostId(), "a host speaks only for itself")
		}
		return heard[alices.Id] && heard[bobs.Id] && heard["host"]
	})

	// Alice opens the console later: her window is her VM and the host.
	aliceSt, err := e.usage(alice).WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{}))
	require.NoError(t, err)
	mine := collect(t, aliceSt)
	win := (<-mine).GetWindow()
	require.NotNil(t, win)
	require.Len(t, win.GetVms(), 1)
	assert.Equal(t, alices.Id, win.GetVms()[0].GetVmId())
	assert.Equal(t, 1.5, win.GetVms()[0].GetCpuSeconds())
	require.Len(t, win.GetHosts(), 1)
	assert.Equal(t, float64(50), win.GetHosts()[0].GetCpuBusySeconds())

	// The next round reaches her as it arrives; bob's VM never does.
	a.sample(t, &eitriv1.UsageSample{Vms: []*eitriv1.VMUsage{vmUse(bobs.Id, 8), vmUse(alices.Id, 2.5)}})
	got := until(t, mine, func(m *eitriv1.WatchUsageResponse) bool { return m.GetVm().GetCpuSeconds() == 2.5 })
	for _, m := range got {
		assert.NotEqual(t, bobs.Id, m.GetVm().GetVmId(), "bob's usage is not alice's to see")
	}
	assert.Equal(t, alices.Id, got[len(got)-1].GetVm().GetVmId())
	assert.Nil(t, got[len(got)-1].GetVm().MemoryBalloonBytes, "not measured stays absent")

	// One VM's watch starts with that VM's window alone.
	oneSt, err := e.usage(alice).WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{VmId: alices.Id}))
	require.NoError(t, err)
	one := collect(t, oneSt)
	w := (<-one).GetWindow()
	require.Len(t, w.GetVms(), 2, "both samples, oldest first")
	assert.Equal(t, []float64{1.5, 2.5}, []float64{w.GetVms()[0].GetCpuSeconds(), w.GetVms()[1].GetCpuSeconds()})
	assert.Empty(t, w.GetHosts())
}

func TestUsageOfAVMTheCallerCannotSeeIsNotFoundAndStrangersGetNothing(t *testing.T) {
	e, a, hostID, alice, _, _, bobs := usageFleet(t)
	ctx := context.Background()
	a.sample(t, &eitriv1.UsageSample{Vms: []*eitriv1.VMUsage{vmUse(bobs.Id, 7)}})

	st, err := e.usage(alice).WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{VmId: bobs.Id}))
	require.NoError(t, err)
	assert.False(t, st.Receive(), "no window at all, not even an empty one")
	assert.Equal(t, connect.CodeNotFound, code(st.Err()))
	st.Close()

	for name, c := range map[string]eitriv1connect.UsageServiceClient{
		"no token":  eitriv1connect.NewUsageServiceClient(e.http, e.url),
		"bad token": e.usage("eitri_pat_nonsense"),
	} {
		st, err := c.WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{}))
		require.NoError(t, err, name)
		assert.False(t, st.Receive(), name)
		assert.Equal(t, connect.CodeUnauthenticated, code(st.Err()), name)
		st.Close()
	}

	st, err = e.usage(alice).WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{VmId: bobs.Id, HostId: hostID}))
	require.NoError(t, err)
	assert.False(t, st.Receive())
	assert.Equal(t, connect.CodeInvalidArgument, code(st.Err()))
	st.Close()
}
