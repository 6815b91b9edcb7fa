package reconcile

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func owned(d *eitriv1.VMDesired, owner string) *eitriv1.VMDesired {
	d.Owner = owner
	return d
}

func TestOwnerFromTheWireIsBootedWithAndRecorded(t *testing.T) {
	f := setup(t)
	f.apply(snap(1, owned(vm("vm1"), "user-a")))
	f.eventuallyRow("vm1", phaseIs("ready"), "created")
	assert.Equal(t, "user-a", f.hv.ownerOf("vm1"), "the hypervisor booted it as user-a's")
	assert.Equal(t, "user-a", f.record("vm1").Spec.Owner, "the owner survives an agent restart")
	assert.Zero(t, f.hv.count("setowner"), "nothing changed after the boot")

	// A restarted engine that finds the VM running keeps it as it was.
	f2 := setupOn(t, f.st, f.hv)
	f2.apply(snap(2, owned(vm("vm1"), "user-a")))
	assert.Zero(t, f.hv.count("setowner"))
}

// A control plane that did not send owners (every guest isolated) is
// upgraded: its next snapshot names them, and running guests follow without
// a reboot; the periodic pass retries a change that failed.
func TestOwnerArrivingLaterReachesTheRunningVM(t *testing.T) {
	f := setup(t, func(c *Config) { c.ResyncInterval = 5 * time.Millisecond })
	f.apply(snap(1, vm("vm1")))
	f.eventuallyRow("vm1", phaseIs("ready"), "created")
	assert.Empty(t, f.hv.ownerOf("vm1"))
	assert.Empty(t, f.record("vm1").Spec.Owner)

	f.hv.set(func(h *fakeHyper) { h.setOwnerErr = errors.New("nft: busy") })
	require.True(t, f.eng.Apply(snap(2, owned(vm("vm1"), "user-a"))))
	require.Eventually(t, func() bool { return f.hv.count("setowner") >= 2 }, 5*time.Second, time.Millisecond, "retried")
	assert.Empty(t, f.record("vm1").Spec.Owner, "the record changes only once the hypervisor has")
	assert.Equal(t, "ready", f.row("vm1").GetPhase(), "a failed owner change does not unsettle the VM")

	f.hv.set(func(h *fakeHyper) { h.setOwnerErr = nil })
	require.Eventually(t, func() bool { return f.hv.ownerOf("vm1") == "user-a" }, 5*time.Second, time.Millisecond)
	require.Eventually(t, func() bool { return f.record("vm1").Spec.Owner == "user-a" }, 5*time.Second, time.Millisecond)
	calls := f.hv.count("setowner")
	f.waitPasses("vm1", 3)
	assert.Equal(t, calls, f.hv.count("setowner"), "an owner already set is not set again")
	assert.Equal(t, 1, f.hv.count("boot"), "no reboot for it")
}
