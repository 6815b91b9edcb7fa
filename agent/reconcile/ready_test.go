package reconcile

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// A guest with an address that is not ready yet is reported with its
// address, still booting; once the hypervisor says it is ready, the row
// says by what. Every row of a VM seeded with a login user names it.
func TestAGuestIsReadyWhenTheHypervisorSaysNotWhenItLeases(t *testing.T) {
	// Passes re-run on their own: readiness comes without a new snapshot.
	f := setup(t, func(c *Config) { c.ResyncInterval = 20 * time.Millisecond })
	f.hv.set(func(h *fakeHyper) { h.notReady = true })
	f.apply(snap(1, vm("vm1")))
	r := f.eventuallyRow("vm1", detailIs(sayWaitingForReady), "leased, not ready")
	assert.Equal(t, "creating", r.GetPhase())
	assert.NotEmpty(t, r.GetIp(), "the address is reported before the guest is ready")
	assert.Empty(t, r.GetReadySignal())
	assert.Equal(t, DefaultLoginUser, r.GetLoginUser())
	assert.Equal(t, DefaultLoginUser, f.seeds.last().LoginUser, "the seed creates the user the row names")
	f.waitPasses("vm1", 3)
	assert.Equal(t, "creating", f.row("vm1").GetPhase(), "later passes over the create's own boot still say creating, not starting")

	f.hv.set(func(h *fakeHyper) { h.notReady = false })
	r = f.eventuallyRow("vm1", phaseIs("ready"), "ready once the hypervisor says so")
	assert.Equal(t, "fake", r.GetReadySignal())
	assert.Equal(t, DefaultLoginUser, r.GetLoginUser())
	assert.Equal(t, DefaultLoginUser, f.record("vm1").LoginUser, "kept with the record")
}

// NarrateAddress puts the address a booting guest took into the rows the
// pass publishes from then on.
func TestNarrateAddressReportsTheAddressWhileBooting(t *testing.T) {
	f := setup(t, func(c *Config) { c.LoginUser = "ops" })
	addr := netip.MustParseAddr("10.0.0.99")
	entered := make(chan struct{})
	release := make(chan struct{})
	f.hv.set(func(h *fakeHyper) {
		h.bootWait = func(ctx context.Context, id string) error {
			NarrateAddress(ctx, addr, "waiting for cloud-init")
			close(entered)
			select {
			case <-release:
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	})
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	<-entered
	r := f.eventuallyRow("vm1", detailIs("waiting for cloud-init"), "narrated")
	assert.Equal(t, addr.String(), r.GetIp())
	assert.Equal(t, "ops", r.GetLoginUser(), "the configured login user")
	close(release)
	f.eventuallyRow("vm1", func(r *eitriv1.ActualVM) bool { return r.GetPhase() == "ready" }, "ready")
	require.Equal(t, "ops", f.seeds.last().LoginUser)
}

// The image's readiness reaches the hypervisor's judgement through the
// VM's record, so a guest adopted after a restart is judged the same way.
func TestAGuestIsJudgedAsItsImageSays(t *testing.T) {
	f := setup(t)
	d := vm("vm1")
	d.Readiness = eitriv1.ImageReadiness_IMAGE_READINESS_ADDRESS
	f.apply(snap(1, d, vm("vm2")))
	f.eventuallyRow("vm1", phaseIs("ready"), "ready")
	f.eventuallyRow("vm2", phaseIs("ready"), "ready")
	assert.Equal(t, state.ReadinessAddress, f.record("vm1").Spec.Readiness, "kept with the record")
	var how1, how2 state.Readiness
	f.hv.set(func(h *fakeHyper) { how1, how2 = h.judgedAs["vm1"], h.judgedAs["vm2"] })
	assert.Equal(t, state.ReadinessAddress, how1)
	assert.Equal(t, state.ReadinessDefault, how2, "an image that says nothing gets the host's default")
}
