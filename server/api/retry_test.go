package api_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// vmIs polls GetVM until the VM's lifecycle is want and returns it.
func (e *env) vmIs(id, want string) *eitriv1.VM {
	e.t.Helper()
	return e.vmWhere(id, func(v *eitriv1.VM) bool { return v.GetLifecycle() == want }, "lifecycle "+want)
}

// vmWhere polls GetVM until cond holds and returns the VM.
func (e *env) vmWhere(id string, cond func(*eitriv1.VM) bool, what string) *eitriv1.VM {
	e.t.Helper()
	var got *eitriv1.VM
	require.Eventually(e.t, func() bool {
		r, err := e.vms(e.admin).GetVM(context.Background(), connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		if err != nil {
			return false
		}
		got = r.Msg.Vm
		return cond(got)
	}, 5*time.Second, 5*time.Millisecond, "%s (last seen %s: %q)", what, got.GetLifecycle(), got.GetStatusDetail())
	return got
}

func lifecycleAndDetail(lc, detail string) func(*eitriv1.VM) bool {
	return func(v *eitriv1.VM) bool { return v.GetLifecycle() == lc && v.GetStatusDetail() == detail }
}

func (e *env) events(id string) []*eitriv1.VMEvent {
	e.t.Helper()
	r, err := e.vms(e.admin).ListVMEvents(context.Background(), connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: id}))
	require.NoError(e.t, err)
	return r.Msg.Events
}

func eventsOfKind(evs []*eitriv1.VMEvent, kind string) []*eitriv1.VMEvent {
	var out []*eitriv1.VMEvent
	for _, ev := range evs {
		if ev.GetKind() == kind {
			out = append(out, ev)
		}
	}
	return out
}

func TestRetryStartsAFailedVMOverOnItsHost(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice := e.tenant("alice")
	vm := e.mustCreateVM(alice, createReq("web-1"))
	first := a.next(t).Vms[0]
	assert.Zero(t, first.GetRetry())

	report := func(r *eitriv1.ActualVM) {
		a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{r}})
	}
	report(&eitriv1.ActualVM{VmId: vm.Id, Power: "running", Phase: "ready", Ip: "10.77.0.5"})
	e.vmIs(vm.Id, "ready")
	_, err := e.vms(alice).RetryVM(ctx, connect.NewRequest(&eitriv1.RetryVMRequest{Id: vm.Id}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err), "a VM that did not fail has nothing to retry")

	report(&eitriv1.ActualVM{VmId: vm.Id, Power: "stopped", Phase: "failed", LastError: "fetch: connection reset"})
	e.vmIs(vm.Id, "failed")

	bob := e.tenant("bob")
	_, err = e.vms(bob).RetryVM(ctx, connect.NewRequest(&eitriv1.RetryVMRequest{Id: vm.Id}))
	assert.Equal(t, connect.CodeNotFound, code(err), "another user's VM is not there to retry")

	r, err := e.vms(alice).RetryVM(ctx, connect.NewRequest(&eitriv1.RetryVMRequest{Id: vm.Id}))
	require.NoError(t, err)
	assert.Equal(t, "retrying", r.Msg.Vm.Lifecycle, "the request shows at once")
	snap := a.next(t)
	require.Len(t, snap.Vms, 1)
	assert.Equal(t, uint64(1), snap.Vms[0].GetRetry(), "the host is told")
	assert.Greater(t, snap.Vms[0].GetVersion(), first.GetVersion(), "a retry is a desired change")

	again, err := e.vms(alice).RetryVM(ctx, connect.NewRequest(&eitriv1.RetryVMRequest{Id: vm.Id}))
	require.NoError(t, err, "asking again while the retry is on its way is the same request")
	assert.Equal(t, "retrying", again.Msg.Vm.Lifecycle)
	got, err := e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: vm.Id}))
	require.NoError(t, err)
	assert.Equal(t, "pending", got.Msg.Vm.Status, "the durable status no longer says failed")

	// A report the host sent before it saw the retry changes nothing.
	report(&eitriv1.ActualVM{VmId: vm.Id, Power: "stopped", Phase: "failed", LastError: "fetch: connection reset", Ip: "10.77.0.9"})
	stale := e.vmWhere(vm.Id, func(v *eitriv1.VM) bool { return v.AssignedIp == "10.77.0.9" }, "the stale report lands")
	assert.Equal(t, "retrying", stale.Lifecycle)
	assert.Equal(t, "pending", stale.Status)

	report(&eitriv1.ActualVM{VmId: vm.Id, Power: "stopped", Phase: "creating", StatusDetail: "downloading image", Retry: 1})
	e.vmWhere(vm.Id, lifecycleAndDetail("creating", "downloading image"), "the host answers the retry")

	// Failing again under the retry is failed again.
	report(&eitriv1.ActualVM{VmId: vm.Id, Power: "stopped", Phase: "failed", LastError: "disk full", Retry: 1})
	e.vmIs(vm.Id, "failed")

	retried := eventsOfKind(e.events(vm.Id), "retried")
	require.Len(t, retried, 1)
	assert.Equal(t, "retry requested after: fetch: connection reset", retried[0].Message)
}

func TestRetryOfADeletedVMIsRefused(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	vm := e.mustCreateVM(e.admin, createReq("web-1"))
	a.next(t)
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{{VmId: vm.Id, Power: "stopped", Phase: "failed", LastError: "boom"}}})
	e.vmIs(vm.Id, "failed")
	_, err := e.vms(e.admin).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: vm.Id}))
	require.NoError(t, err)
	_, err = e.vms(e.admin).RetryVM(ctx, connect.NewRequest(&eitriv1.RetryVMRequest{Id: vm.Id}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "restore it first")
}

func TestAGuestThatExitedUnaskedIsAnEventOnce(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	vm := e.mustCreateVM(e.admin, createReq("web-1"))
	a.next(t)
	up := &eitriv1.ActualVM{VmId: vm.Id, Power: "running", Phase: "ready", Ip: "10.77.0.5"}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{up}})
	e.vmIs(vm.Id, "ready")

	exit := &eitriv1.GuestExit{Reason: "qemu exited (signal 9)", SerialTail: "[    1.234] Run /init as init process\nudhcpc: sending discover", AtUnix: time.Now().Unix()}
	restarting := &eitriv1.ActualVM{VmId: vm.Id, Power: "stopped", Phase: "restarting", Ip: "10.77.0.5",
		StatusDetail: "qemu exited (signal 9); restarting, attempt 1", UnexpectedExits: 1, LastExit: exit}
	rep := &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{restarting}}
	a.report(t, rep)
	e.vmWhere(vm.Id, lifecycleAndDetail("restarting", "qemu exited (signal 9); restarting, attempt 1"), "the host's narration")

	require.Eventually(t, func() bool { return len(eventsOfKind(e.events(vm.Id), "exited")) == 1 }, 5*time.Second, 5*time.Millisecond)
	ev := eventsOfKind(e.events(vm.Id), "exited")[0]
	assert.True(t, strings.HasPrefix(ev.Message, "qemu exited (signal 9); serial console:\n"), ev.Message)
	assert.Contains(t, ev.Message, "udhcpc: sending discover")

	// The same facts again — a heartbeat, a reconnect — record nothing new.
	a.report(t, rep)
	a2 := e.open(h, cred, &eitriv1.Hello{AgentVersion: "test"})
	a2.next(t)
	a2.report(t, rep)
	up.UnexpectedExits, up.LastExit = 1, exit
	a2.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{up}})
	e.vmIs(vm.Id, "ready")
	assert.Len(t, eventsOfKind(e.events(vm.Id), "exited"), 1)

	// Exits the control plane missed are counted in the next one it hears of.
	up.UnexpectedExits = 4
	up.LastExit = &eitriv1.GuestExit{Reason: "qemu exited (status 1)"}
	a2.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{up}})
	require.Eventually(t, func() bool { return len(eventsOfKind(e.events(vm.Id), "exited")) == 2 }, 5*time.Second, 5*time.Millisecond)
	assert.Equal(t, "qemu exited (status 1) (the latest of 3 exits since the last one recorded); the serial console was empty",
		eventsOfKind(e.events(vm.Id), "exited")[1].Message)
}

func TestStartStopAndRestoreShowAtOnceAndTheReportConfirms(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	vm := e.mustCreateVM(e.admin, createReq("web-1"))
	a.next(t)
	report := func(r *eitriv1.ActualVM) {
		r.VmId = vm.Id
		a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{r}})
	}
	report(&eitriv1.ActualVM{Power: "running", Phase: "ready", Ip: "10.77.0.5"})
	e.vmIs(vm.Id, "ready")

	stop, err := e.vms(e.admin).StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: vm.Id}))
	require.NoError(t, err)
	assert.Equal(t, "stopping", stop.Msg.Vm.Lifecycle, "not 'ready' while the guest still runs")
	report(&eitriv1.ActualVM{Power: "running", Phase: "stopping", StatusDetail: "shutting down (ACPI)"})
	e.vmWhere(vm.Id, lifecycleAndDetail("stopping", "shutting down (ACPI)"), "the host's narration")
	report(&eitriv1.ActualVM{Power: "stopped", Phase: "stopped"})
	assert.Empty(t, e.vmIs(vm.Id, "stopped").StatusDetail)

	start, err := e.vms(e.admin).StartVM(ctx, connect.NewRequest(&eitriv1.StartVMRequest{Id: vm.Id}))
	require.NoError(t, err)
	assert.Equal(t, "starting", start.Msg.Vm.Lifecycle, "not 'stopped' while the host boots it")
	report(&eitriv1.ActualVM{Power: "running", Phase: "starting", StatusDetail: "waiting for an address"})
	e.vmWhere(vm.Id, lifecycleAndDetail("starting", "waiting for an address"), "the host's narration")
	report(&eitriv1.ActualVM{Power: "running", Phase: "ready", Ip: "10.77.0.5"})
	e.vmIs(vm.Id, "ready")

	_, err = e.vms(e.admin).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: vm.Id}))
	require.NoError(t, err)
	report(&eitriv1.ActualVM{Power: "stopped", Phase: "deleting"})
	// "deleting" shows from the request on; wait for the host's report too,
	// or the restore below could race it and see the host still "ready".
	e.vmWhere(vm.Id, func(v *eitriv1.VM) bool { return v.GetLifecycle() == "deleting" && v.GetPhase() == "deleting" },
		"the host's deleting report")
	restore, err := e.vms(e.admin).RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: vm.Id}))
	require.NoError(t, err)
	assert.Equal(t, "restoring", restore.Msg.Vm.Lifecycle, "not 'deleting' until the next report")
	report(&eitriv1.ActualVM{Power: "stopped", Phase: "starting", StatusDetail: "starting"})
	e.vmWhere(vm.Id, lifecycleAndDetail("starting", "starting"), "the host's narration")
	report(&eitriv1.ActualVM{Power: "running", Phase: "ready", Ip: "10.77.0.5"})
	e.vmIs(vm.Id, "ready")

	// The last event is written just after the view shows "ready".
	want := []string{"pending → ready at 10.77.0.5", "ready → stopped", "stopped → ready at 10.77.0.5"}
	var statuses []string
	require.Eventually(t, func() bool {
		statuses = statuses[:0]
		for _, ev := range eventsOfKind(e.events(vm.Id), "status") {
			statuses = append(statuses, ev.Message)
		}
		return len(statuses) >= len(want)
	}, 5*time.Second, 5*time.Millisecond)
	assert.Equal(t, want, statuses, "passing words (starting, stopping) are not statuses")
}
