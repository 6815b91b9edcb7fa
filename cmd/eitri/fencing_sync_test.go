package main

import (
	"context"
	"net/netip"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/reconcile"
	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/agent/syncclient"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

// startControlPlaneAt is startControlPlane on a clock of the test's.
func startControlPlaneAt(t *testing.T, dir, addr string, now func() time.Time) *controlPlane {
	t.Helper()
	return startControlPlaneWith(t, addr, server.Config{DataDir: dir, Now: now})
}

// guests stands in for QEMU behind the real reconcile engine: guests are
// flags.
type guests struct {
	mu      sync.Mutex
	running map[string]bool
}

func (g *guests) set(id string, on bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.running[id] = on
}

func (g *guests) isRunning(id string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.running[id]
}

func (g *guests) Preflight(context.Context, state.VMSpec) error               { return nil }
func (g *guests) PrepareRootDisk(context.Context, state.VMSpec, string) error { return nil }
func (g *guests) Boot(_ context.Context, s state.VMSpec, _ string) error {
	g.set(s.ID, true)
	return nil
}
func (g *guests) Shutdown(_ context.Context, id string) error { g.set(id, false); return nil }
func (g *guests) Power(_ context.Context, id string) (bool, error) {
	return g.isRunning(id), nil
}
func (g *guests) Address(context.Context, string) (netip.Addr, bool) {
	return netip.MustParseAddr("10.77.0.9"), true
}
func (g *guests) Ready(context.Context, string, state.Readiness) (string, bool) { return "dhcp", true }
func (g *guests) SetOwner(context.Context, string, string) error                { return nil }
func (g *guests) Exited(context.Context, string) (reconcile.GuestExit, bool) {
	return reconcile.GuestExit{}, false
}
func (g *guests) Destroy(_ context.Context, id string) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	delete(g.running, id)
	return nil
}

// measured adds the host's capacity to the engine's report.
type measured struct{ *reconcile.Engine }

func (m measured) Fill(rep *eitriv1.ActualStateReport) {
	m.Engine.Fill(rep)
	rep.Capacity = &eitriv1.Capacity{Vcpus: 4, MemMb: 8192, DiskGb: 100}
}

// A control plane whose clock stepped back an hour across a restart still
// sends snapshots the agent applies: generations come from a stored
// counter. With wall-clock generations the agent dropped every snapshot of
// the restarted control plane, silently, and a stop never reached the VM.
func TestSnapshotsStillApplyAfterTheControlPlaneClockStepsBackAcrossARestart(t *testing.T) {
	dir := t.TempDir()
	start := time.Now()
	cp := startControlPlaneAt(t, dir, "127.0.0.1:0", func() time.Time { return start.Add(time.Since(start)) })
	jt, err := cp.srv.Fleet.CreateJoinToken(cp.admin(), time.Minute)
	require.NoError(t, err)
	id, err := syncclient.Enroll(context.Background(), jt.Token, "h1", "test")
	require.NoError(t, err)

	eng, hv := engineOverGuests(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_ = syncclient.Run(ctx, syncclient.Config{
			Identity: id, Source: measured{eng}, ReportEvery: 20 * time.Millisecond, Heartbeat: time.Second,
			MinBackoff: 50 * time.Millisecond, MaxBackoff: 200 * time.Millisecond,
			Hello: func() *eitriv1.Hello {
				cpID, epoch, gen := eng.Lineage()
				return &eitriv1.Hello{AgentVersion: "test", ControlPlaneId: cpID, AppliedEpoch: epoch, AppliedGeneration: gen}
			},
		})
	}()
	require.Eventually(t, func() bool {
		h, err := cp.srv.Fleet.GetHost(cp.admin(), id.HostID)
		return err == nil && h.Capacity != nil
	}, 10*time.Second, 10*time.Millisecond)
	vm, err := cp.srv.Fleet.CreateVM(cp.admin(), &eitriv1.CreateVMRequest{
		Name: "web-1", ImageUrl: "http://x/y.raw", ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
		Vcpus: 1, MemMb: 256, DiskGb: 1,
	})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return hv.isRunning(vm.Id) }, 10*time.Second, 10*time.Millisecond, "the VM boots")
	_, _, before := eng.Lineage()

	addr := cp.addr
	cp.stop()
	cp2 := startControlPlaneAt(t, dir, addr, func() time.Time { return start.Add(-time.Hour).Add(time.Since(start)) })
	_, err = cp2.srv.Fleet.SetPower(cp2.admin(), vm.Id, "stopped")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return !hv.isRunning(vm.Id) }, 10*time.Second, 10*time.Millisecond,
		"the stop sent by the control plane whose clock went back is applied")
	_, _, after := eng.Lineage()
	assert.Greater(t, after, before)
	rep := eng.Report()
	assert.Nil(t, rep.GetSnapshotRefused())
	assert.Empty(t, rep.GetQuarantined())
	require.Eventually(t, func() bool {
		v, err := cp2.srv.Fleet.GetVM(cp2.admin(), vm.Id)
		return err == nil && v.Lifecycle == "stopped"
	}, 10*time.Second, 10*time.Millisecond)
	h, err := cp2.srv.Fleet.GetHost(cp2.admin(), id.HostID)
	require.NoError(t, err)
	assert.Empty(t, h.Conditions)
}

// engineOverGuests is a real reconcile engine over in-memory guests: the
// agent's logic end to end, with no QEMU, image or seed behind it.
func engineOverGuests(t *testing.T) (*reconcile.Engine, *guests) {
	t.Helper()
	st, err := state.Open(t.TempDir())
	require.NoError(t, err)
	hv := &guests{running: map[string]bool{}}
	eng, err := reconcile.New(reconcile.Config{
		Hyper: hv, St: st, ResyncInterval: 50 * time.Millisecond,
		Images: func(context.Context, string, string, func(int64, int64)) (string, func(), error) {
			return "/cache/base.raw", func() {}, nil
		},
		Seed: func(string, reconcile.SeedParams) error { return nil },
	})
	require.NoError(t, err)
	t.Cleanup(eng.Close)
	return eng, hv
}
