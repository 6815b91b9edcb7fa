package reconcile

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// gate lets a test hold a fake boot or shutdown at a point and release it.
type gate struct {
	entered chan string
	release chan struct{}
}

func newGate() *gate { return &gate{entered: make(chan string, 8), release: make(chan struct{})} }

func (g *gate) hold(say string) func(ctx context.Context, id string) error {
	return func(ctx context.Context, id string) error {
		if say != "" {
			Narrate(ctx, say)
		}
		g.entered <- id
		select {
		case <-g.release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (f *fixture) readyVM(id string, opts ...func(*eitriv1.VMDesired)) *eitriv1.VMDesired {
	f.t.Helper()
	d := vm(id)
	for _, o := range opts {
		o(d)
	}
	f.apply(snap(1, d))
	f.eventuallyRow(id, phaseIs("ready"), "created")
	return d
}

// upAfterExits: ready again, having counted n unasked exits.
func upAfterExits(n uint32) func(*eitriv1.ActualVM) bool {
	return func(r *eitriv1.ActualVM) bool { return r.GetPhase() == "ready" && r.GetUnexpectedExits() == n }
}

func TestAStartSaysStartingThenWaitingForAnAddress(t *testing.T) {
	f := setup(t)
	d := stopped(vm("vm1"))
	f.apply(snap(1, d))
	require.Equal(t, "stopped", f.row("vm1").GetPhase())

	g := newGate()
	f.hv.set(func(h *fakeHyper) { h.bootWait = g.hold("waiting for an address") })
	require.True(t, f.eng.Apply(snap(2, vm("vm1"))))
	<-g.entered
	r := f.eventuallyRow("vm1", detailIs("waiting for an address"), "the hypervisor narrates through the pass")
	assert.Equal(t, "starting", r.GetPhase())
	assert.Equal(t, "running", r.GetPower(), "it is said once the guest process runs")
	close(g.release)
	f.waitIdle()
	r = f.row("vm1")
	assert.Equal(t, "ready", r.GetPhase())
	assert.Empty(t, r.GetStatusDetail(), "a settled VM says nothing")
}

func TestAStartNarratesItsFirstStepBeforeBooting(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, stopped(vm("vm1"))))
	var said []*eitriv1.ActualVM
	rec := f.record("vm1")
	out := f.eng.converge(context.Background(), vm("vm1"), rec, nil, func(r *eitriv1.ActualVM) { said = append(said, r) })
	require.NotEmpty(t, said)
	assert.Equal(t, "starting", said[0].GetPhase())
	assert.Equal(t, "starting", said[0].GetStatusDetail())
	assert.Equal(t, "stopped", said[0].GetPower())
	assert.Equal(t, "ready", out.row.GetPhase())
}

func TestAStopSaysShuttingDownThenForcing(t *testing.T) {
	f := setup(t)
	f.readyVM("vm1")
	g := newGate()
	f.hv.set(func(h *fakeHyper) {
		h.shutdownWait = func(ctx context.Context, id string) error {
			g.entered <- id
			<-g.release
			Narrate(ctx, "forcing off after 30 s")
			g.entered <- id
			<-g.release
			return nil
		}
	})
	require.True(t, f.eng.Apply(snap(2, stopped(vm("vm1")))))
	<-g.entered
	r := f.eventuallyRow("vm1", detailIs("shutting down (ACPI)"), "the stop is narrated")
	assert.Equal(t, "stopping", r.GetPhase())
	assert.Equal(t, "running", r.GetPower())
	g.release <- struct{}{}
	<-g.entered
	f.eventuallyRow("vm1", detailIs("forcing off after 30 s"), "forcing it is narrated")
	g.release <- struct{}{}
	f.waitIdle()
	r = f.row("vm1")
	assert.Equal(t, "stopped", r.GetPhase())
	assert.Empty(t, r.GetStatusDetail())
}

// The defect: QEMU died, the agent booted it again, and the VM read "ready"
// for the whole reboot with nothing said or recorded.
func TestAGuestThatExitedIsRestartedAndSaysWhatHappened(t *testing.T) {
	f := setup(t, func(c *Config) { c.ResyncInterval = 2 * time.Millisecond })
	f.readyVM("vm1")
	require.Equal(t, "10.0.0.10", f.row("vm1").GetIp())

	g := newGate()
	f.hv.set(func(h *fakeHyper) {
		h.bootWait = g.hold("waiting for an address")
		h.noAddress = true // the new boot has not taken its address yet
	})
	f.hv.exit("vm1", GuestExit{Reason: "qemu exited (signal 9)", SerialTail: "[    1.2] Run /init as init process"})
	<-g.entered
	r := f.eventuallyRow("vm1", detailIs("waiting for an address"), "the restart is in flight")
	assert.Equal(t, "restarting", r.GetPhase(), "never 'ready' while it reboots")
	assert.EqualValues(t, 1, r.GetUnexpectedExits())
	require.NotNil(t, r.GetLastExit())
	assert.Equal(t, "qemu exited (signal 9)", r.GetLastExit().GetReason())
	assert.Equal(t, "[    1.2] Run /init as init process", r.GetLastExit().GetSerialTail())
	assert.Equal(t, f.clock.Now().Unix(), r.GetLastExit().GetAtUnix())

	// Booted, but without an address in this boot it is not ready: the
	// address the guest held before says nothing about this boot.
	close(g.release)
	r = f.eventuallyRow("vm1", detailIs("waiting for an address"), "booted, no address yet")
	assert.Equal(t, "restarting", r.GetPhase())
	f.hv.set(func(h *fakeHyper) { h.noAddress = false })
	r = f.eventuallyRow("vm1", phaseIs("ready"), "up again")
	assert.EqualValues(t, 1, r.GetUnexpectedExits(), "the exit stays reported: the count never goes down")
	assert.Equal(t, 2, f.hv.count("boot"))
	rec := f.record("vm1")
	assert.Equal(t, 1, rec.Exits)
	assert.Equal(t, 1, rec.Restarts)
}

func TestTheFirstRestartIsNarratedWithItsCause(t *testing.T) {
	f := setup(t)
	f.readyVM("vm1")
	f.hv.exit("vm1", GuestExit{Reason: "qemu exited (signal 9)"})
	var said []string
	out := f.eng.converge(context.Background(), vm("vm1"), f.record("vm1"), nil, func(r *eitriv1.ActualVM) {
		said = append(said, r.GetPhase()+": "+r.GetStatusDetail())
	})
	assert.Equal(t, []string{"restarting: qemu exited (signal 9); restarting, attempt 1"}, said)
	assert.Equal(t, "ready", out.row.GetPhase())
}

func TestRepeatedExitsBackOffAndEndFailedWithTheReason(t *testing.T) {
	f := setup(t, planned, func(c *Config) {
		c.MaxRestarts = 3
		c.RetryBackoff = 10 * time.Second
		c.ResyncInterval = 2 * time.Millisecond
	})
	d := f.readyVM("vm1")
	crash := func() { f.hv.exit("vm1", GuestExit{Reason: "qemu exited (signal 9)", SerialTail: "kernel panic"}) }
	boots := func() int { return f.hv.count("boot") }

	crash()
	f.eventuallyRow("vm1", upAfterExits(1), "the first restart is at once")
	assert.Equal(t, 2, boots())

	crash()
	r := f.eventuallyRow("vm1", detailIs("qemu exited (signal 9); restarting in 10 s, attempt 2"), "the second waits")
	assert.Equal(t, "restarting", r.GetPhase())
	assert.Equal(t, "stopped", r.GetPower())
	f.waitPasses("vm1", 5)
	assert.Equal(t, 2, boots(), "no restart before its time")
	f.clock.Advance(10 * time.Second)
	f.eventuallyRow("vm1", upAfterExits(2), "restarted after the wait")

	crash()
	f.eventuallyRow("vm1", detailIs("qemu exited (signal 9); restarting in 20 s, attempt 3"), "the wait doubles")
	f.clock.Advance(20 * time.Second)
	f.eventuallyRow("vm1", upAfterExits(3), "restarted")

	crash()
	r = f.eventuallyRow("vm1", phaseIs("failed"), "past the budget the VM fails")
	assert.Equal(t, "qemu exited (signal 9); gave up after 3 restarts in a row", r.GetLastError())
	assert.Empty(t, r.GetStatusDetail())
	assert.EqualValues(t, 4, r.GetUnexpectedExits())
	f.clock.Advance(time.Hour)
	f.waitPasses("vm1", 5)
	assert.Equal(t, 4, boots(), "a failed VM stays down")
	assert.Equal(t, "failed", f.row("vm1").GetPhase())

	// A retry gives it a fresh budget at once.
	f.apply(snap(2, retried(d, 1)))
	r = f.eventuallyRow("vm1", phaseIs("ready"), "the retry boots it")
	assert.Equal(t, uint64(1), r.GetRetry())
	assert.EqualValues(t, 4, r.GetUnexpectedExits())
	rec := f.record("vm1")
	assert.False(t, rec.Failed)
	assert.Zero(t, rec.Restarts)
}

func TestAGuestThatStaysUpHasItsFailedRunsForgotten(t *testing.T) {
	f := setup(t, planned, func(c *Config) {
		c.StableAfter = 10 * time.Minute
		c.ResyncInterval = 2 * time.Millisecond
	})
	f.readyVM("vm1")
	f.hv.exit("vm1", GuestExit{Reason: "qemu exited (status 1)"})
	f.eventuallyRow("vm1", upAfterExits(1), "restarted")
	require.Equal(t, 1, f.record("vm1").Restarts)

	f.clock.Advance(10 * time.Minute)
	require.Eventually(t, func() bool { return f.record("vm1").Restarts == 0 }, 5*time.Second, time.Millisecond,
		"up for StableAfter: the restart budget is whole again")
	f.hv.exit("vm1", GuestExit{Reason: "qemu exited (status 1)"})
	f.eventuallyRow("vm1", upAfterExits(2), "restarted at once, as a first restart")
}

// A boot that fails spends the restart budget like an exit, and a guest
// that died booting is counted as an exit too.
func TestAFailedStartBacksOffAndCountsAGuestThatDiedBooting(t *testing.T) {
	f := setup(t, planned, func(c *Config) { c.RetryBackoff = 10 * time.Second })
	f.apply(snap(1, stopped(vm("vm1"))))
	f.hv.set(func(h *fakeHyper) {
		h.bootWait = func(ctx context.Context, id string) error {
			h.exit(id, GuestExit{Reason: "qemu exited (signal 6)", SerialTail: "Kernel panic - not syncing"})
			return errors.New("hostvm: vm vm1: QEMU exited before the guest took an address; serial console:\nKernel panic - not syncing")
		}
	})
	r := findVM(f.apply(snap(2, vm("vm1"))), "vm1")
	assert.Equal(t, "restarting", r.GetPhase())
	assert.Equal(t, "qemu exited (signal 6); restarting, attempt 1", r.GetStatusDetail())
	assert.Contains(t, r.GetLastError(), "QEMU exited before the guest took an address")
	assert.EqualValues(t, 1, r.GetUnexpectedExits())
	assert.Equal(t, "Kernel panic - not syncing", r.GetLastExit().GetSerialTail())

	d := vm("vm1")
	d.Vcpus = 2 // a change, so a pass runs
	r = findVM(f.apply(snap(3, d)), "vm1")
	assert.Equal(t, "qemu exited (signal 6); restarting in 10 s, attempt 2", r.GetStatusDetail())
	assert.EqualValues(t, 2, r.GetUnexpectedExits(), "counted once per exit, not again by the next pass")
}

func TestAnExitOfAStoppedVMIsCountedButNotRestarted(t *testing.T) {
	f := setup(t)
	f.readyVM("vm1")
	f.hv.exit("vm1", GuestExit{Reason: "qemu exited (signal 9)"})
	r := findVM(f.apply(snap(2, stopped(vm("vm1")))), "vm1")
	assert.Equal(t, "stopped", r.GetPhase())
	assert.EqualValues(t, 1, r.GetUnexpectedExits())
	assert.Equal(t, 1, f.hv.count("boot"))
	assert.Zero(t, f.record("vm1").Restarts)
}
