package api_test

import (
	"context"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/fleet"
)

// clock is the control plane's settable clock.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = t
}

func (c *clock) Advance(d time.Duration) { c.Set(c.Now().Add(d)) }

// newClockedEnv is newEnv with the control plane on a test clock and a
// destroy sweep fast enough to watch.
func newClockedEnv(t *testing.T) (*env, *clock) {
	t.Helper()
	c := &clock{now: time.Now().UTC()}
	dir := t.TempDir()
	s, err := server.New(context.Background(), server.Config{DataDir: dir, Plaintext: true, DeleteGrace: time.Hour,
		RestoreMargin: time.Minute, DestroySweep: 20 * time.Millisecond, Now: c.Now})
	require.NoError(t, err)
	ts := httptest.NewUnstartedServer(s.Handler())
	ts.EnableHTTP2 = true
	ts.StartTLS()
	t.Cleanup(func() { ts.Close(); s.Close() })
	return &env{t: t, srv: s, url: ts.URL, http: ts.Client(), admin: s.AdminToken, dir: dir}, c
}

// nextWhere waits for a snapshot that satisfies cond, skipping others.
func (a *agent) nextWhere(t *testing.T, cond func(*eitriv1.DesiredStateSnapshot) bool, why string) *eitriv1.DesiredStateSnapshot {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case s, ok := <-a.snaps:
			require.True(t, ok, "stream closed")
			if cond(s) {
				return s
			}
		case <-deadline:
			t.Fatal("no snapshot: " + why)
			return nil
		}
	}
}

func TestARestoreAtTheDestroyDeadlineIsRefusedAndOnlyTheControlPlaneClockSaysDestroy(t *testing.T) {
	e, clk := newClockedEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	created, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	id := created.Msg.Vm.Id
	a.next(t)

	del, err := e.vms(e.admin).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
	require.NoError(t, err)
	destroyAt := del.Msg.Vm.DestroyAt.AsTime()
	assert.Equal(t, destroyAt.Add(-time.Minute), del.Msg.Vm.RestorableUntil.AsTime(), "the console knows when Restore stops working")
	snap := a.nextWhere(t, func(s *eitriv1.DesiredStateSnapshot) bool { return s.Vms[0].Deleted }, "the delete")
	assert.False(t, snap.Vms[0].Destroy, "not before destroy_at")

	// Inside the margin: refused, and the refusal says when it is destroyed.
	clk.Set(destroyAt.Add(-30 * time.Second))
	_, err = e.vms(e.admin).RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: id}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.ErrorContains(t, err, "destroyed at")
	got, err := e.vms(e.admin).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
	require.NoError(t, err)
	assert.True(t, got.Msg.Vm.Deleted, "a refused restore changes nothing")

	// The control plane's clock passes destroy_at: the host is told, unasked.
	clk.Set(destroyAt)
	snap = a.nextWhere(t, func(s *eitriv1.DesiredStateSnapshot) bool { return len(s.Vms) == 1 && s.Vms[0].Destroy }, "the destroy order once destroy_at passes")
	assert.True(t, snap.Vms[0].Deleted)
	_, err = e.vms(e.admin).RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: id}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
}

func TestARestoreBeforeTheMarginBringsTheVMBack(t *testing.T) {
	e, clk := newClockedEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	created, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	id := created.Msg.Vm.Id
	a.next(t)
	del, err := e.vms(e.admin).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
	require.NoError(t, err)
	a.next(t)

	clk.Set(del.Msg.Vm.DestroyAt.AsTime().Add(-2 * time.Minute))
	_, err = e.vms(e.admin).RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: id}))
	require.NoError(t, err)
	snap := a.next(t)
	assert.False(t, snap.Vms[0].Deleted)
	assert.False(t, snap.Vms[0].Destroy)
}

// Generations and versions come from a stored counter: a control plane whose
// clock steps back an hour still sends newer ones, so agents keep applying.
func TestSnapshotsKeepRisingWhenTheControlPlaneClockStepsBack(t *testing.T) {
	e, clk := newClockedEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	created, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	first := a.next(t)
	require.NotEmpty(t, first.ControlPlaneId)
	require.NotZero(t, first.Vms[0].Version)

	clk.Advance(-time.Hour)
	_, err = e.vms(e.admin).StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: created.Msg.Vm.Id}))
	require.NoError(t, err)
	second := a.next(t)
	assert.Greater(t, second.Generation, first.Generation)
	assert.Greater(t, second.Vms[0].Version, first.Vms[0].Version, "the stop is a newer version of the VM")
	assert.Greater(t, second.Vms[0].Version, first.Generation, "newer than any snapshot the agent applied")
	assert.Equal(t, first.Epoch, second.Epoch)
	assert.Equal(t, first.ControlPlaneId, second.ControlPlaneId)
}

// An agent that applied more than this control plane remembers (it was
// restored from an older copy of its database) is never sent a generation it
// already saw: a new epoch starts past it before the first snapshot.
func TestAControlPlaneBehindAnAgentStartsANewEpochBeforeItsFirstSnapshot(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	l, err := e.srv.Store.Lineage(context.Background())
	require.NoError(t, err)
	ahead := l.Generation + 1000
	a := e.open(h, cred, &eitriv1.Hello{AgentVersion: "test", ControlPlaneId: l.ID, AppliedEpoch: l.Epoch, AppliedGeneration: ahead})
	snap := a.next(t)
	assert.Equal(t, l.ID, snap.ControlPlaneId)
	assert.Equal(t, l.Epoch+1, snap.Epoch)
	assert.Greater(t, snap.Generation, ahead)

	// Behind it, nothing moves.
	b := e.open(h, cred, &eitriv1.Hello{AgentVersion: "test", ControlPlaneId: l.ID, AppliedEpoch: snap.Epoch, AppliedGeneration: snap.Generation})
	again := b.next(t)
	assert.Equal(t, snap.Epoch, again.Epoch)
}

// A VM whose row the control plane lost is held by its host and reported;
// the control plane shows it (spec, owner, why) to admins, and an admin takes
// it back with the same id.
func TestALostVMRowIsShownAsOrphanedAndAdoptedBackWithTheSameID(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	created, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	vm := created.Msg.Vm
	applied := a.next(t)
	// The control plane loses the row (an older backup); the agent holds the
	// VM as it applied it and says so.
	require.NoError(t, e.srv.Store.DeleteVM(ctx, vm.Id))
	held := applied.Vms[0]
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Quarantined: []*eitriv1.QuarantinedVM{{
		VmId: vm.Id, Name: vm.Name, Held: held, Power: "running", Reason: "no snapshot names it", SinceUnix: time.Now().Unix(),
	}}, Vms: []*eitriv1.ActualVM{}})

	var orphans []*eitriv1.OrphanedVM
	require.Eventually(t, func() bool {
		r, err := e.vms(e.admin).ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
		require.NoError(t, err)
		orphans = r.Msg.Vms
		return len(orphans) == 1
	}, 5*time.Second, 10*time.Millisecond)
	o := orphans[0]
	assert.Equal(t, h, o.HostId)
	assert.Equal(t, vm.Id, o.VmId)
	assert.Equal(t, "web-1", o.Name)
	assert.Equal(t, vm.OwnerId, o.OwnerId)
	assert.Equal(t, "admin", o.OwnerName)
	assert.Equal(t, vm.ImageUrl, o.ImageUrl)
	assert.Equal(t, int64(256), o.MemMb)
	assert.Equal(t, "running", o.PowerState)
	assert.Equal(t, "running", o.ActualPower)
	assert.False(t, o.HasRow)
	assert.Equal(t, "no snapshot names it", o.Reason)

	var cond *eitriv1.HostCondition
	for _, c := range e.host(h).Conditions {
		if c.Type == fleet.ConditionOrphanedVMs {
			cond = c
		}
	}
	require.NotNil(t, cond, "the host says it holds VMs nobody here knows of")
	assert.Contains(t, cond.Message, "1 VM(s)")

	// Only an admin sees or acts on them.
	tok, err := e.tokens(e.admin).CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "ci", UserName: "alice"}))
	require.NoError(t, err)
	_, err = e.vms(tok.Msg.Secret).ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))
	_, err = e.vms(tok.Msg.Secret).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: vm.Id}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))

	adopted, err := e.vms(e.admin).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: vm.Id}))
	require.NoError(t, err)
	assert.Equal(t, vm.Id, adopted.Msg.Vm.Id, "the same id: the host keeps the same disk")
	assert.Equal(t, vm.OwnerId, adopted.Msg.Vm.OwnerId)
	assert.Equal(t, "running", adopted.Msg.Vm.PowerState)
	assert.False(t, adopted.Msg.Vm.Deleted)
	snap := a.nextWhere(t, func(s *eitriv1.DesiredStateSnapshot) bool { return len(s.Vms) == 1 }, "the adopted VM")
	assert.Equal(t, vm.Id, snap.Vms[0].VmId)
	assert.Greater(t, snap.Vms[0].Version, held.Version, "newer than what the host holds, so it takes the row's word again")
	assert.False(t, snap.Vms[0].Deleted)

	_, err = e.vms(e.admin).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: "vm-nope"}))
	assert.Equal(t, connect.CodeNotFound, code(err))
}

// An orphan whose owner this control plane never heard of is adopted only
// when the admin names one.
func TestAnOrphanOfAnUnknownOwnerNeedsOneNamed(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	held := &eitriv1.VMDesired{VmId: "vm-lost", Name: "db", ImageUrl: "http://images.test/g.raw", ImageSha256: sha,
		Vcpus: 1, MemMb: 512, DiskGb: 4, PowerState: "stopped", Owner: "u-gone", Version: 7}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Quarantined: []*eitriv1.QuarantinedVM{{VmId: "vm-lost", Name: "db", Held: held, Power: "stopped"}}})
	require.Eventually(t, func() bool {
		r, err := e.vms(e.admin).ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
		return err == nil && len(r.Msg.Vms) == 1 && r.Msg.Vms[0].OwnerName == ""
	}, 5*time.Second, 10*time.Millisecond)

	_, err := e.vms(e.admin).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: "vm-lost"}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.ErrorContains(t, err, "owner_id")

	mine, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("db")))
	require.NoError(t, err)
	_, err = e.vms(e.admin).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: "vm-lost", OwnerId: mine.Msg.Vm.OwnerId}))
	assert.Equal(t, connect.CodeAlreadyExists, code(err), "the admin already has a VM named db")
	adopted, err := e.vms(e.admin).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: "vm-lost", OwnerId: mine.Msg.Vm.OwnerId, Name: "db-2"}))
	require.NoError(t, err)
	assert.Equal(t, "vm-lost", adopted.Msg.Vm.Id)
	assert.Equal(t, "db-2", adopted.Msg.Vm.Name)
	assert.Equal(t, "stopped", adopted.Msg.Vm.PowerState, "held stopped, adopted stopped")
}

func TestAnAdminDestroysAnOrphanThroughTheHost(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	held := &eitriv1.VMDesired{VmId: "vm-lost", Name: "db", ImageUrl: "http://images.test/g.raw", ImageSha256: sha,
		Vcpus: 1, MemMb: 512, DiskGb: 4, PowerState: "running", Owner: "u-gone", Version: 7}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Quarantined: []*eitriv1.QuarantinedVM{{VmId: "vm-lost", Name: "db", Held: held, Power: "running"}}})
	require.Eventually(t, func() bool {
		_, err := e.vms(e.admin).DestroyOrphanedVM(ctx, connect.NewRequest(&eitriv1.DestroyOrphanedVMRequest{HostId: h, VmId: "vm-lost"}))
		return err == nil
	}, 5*time.Second, 10*time.Millisecond)

	snap := a.nextWhere(t, func(s *eitriv1.DesiredStateSnapshot) bool { return len(s.Vms) == 1 }, "the destroy order")
	d := snap.Vms[0]
	assert.Equal(t, "vm-lost", d.VmId)
	assert.True(t, d.Deleted)
	assert.True(t, d.Destroy, "destroyed now, not after a grace")
	assert.Greater(t, d.Version, held.Version)

	// The host destroys it and says so: the order's row goes.
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Destroyed: []string{"vm-lost"}})
	require.Eventually(t, func() bool {
		_, err := e.vms(e.admin).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: "vm-lost"}))
		return code(err) == connect.CodeNotFound
	}, 5*time.Second, 10*time.Millisecond)
}

func TestAHostRefusingSnapshotsShowsItUntilItAppliesOneAgain(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), SnapshotRefused: &eitriv1.SnapshotRefusal{
		ControlPlaneId: "cp-x", Epoch: 1, Generation: 5, Reason: "this host belongs to control plane cp-y",
	}})
	var cond *eitriv1.HostCondition
	require.Eventually(t, func() bool {
		cond = nil
		for _, c := range e.host(h).Conditions {
			if c.Type == fleet.ConditionSnapshotRefused {
				cond = c
			}
		}
		return cond != nil
	}, 5*time.Second, 10*time.Millisecond)
	assert.Contains(t, cond.Message, "belongs to control plane cp-y")
	assert.NotNil(t, cond.Since)

	a.report(t, &eitriv1.ActualStateReport{Capacity: big()})
	require.Eventually(t, func() bool { return len(e.host(h).Conditions) == 0 }, 5*time.Second, 10*time.Millisecond)
}
