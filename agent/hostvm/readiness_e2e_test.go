package hostvm

import (
	"context"
	"io"
	"net/http"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/netnstest"
	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/seed"
	"github.com/a73x/eitri/agent/state"
)

// TestAGuestWithoutCloudInitResolvesAndIsReadyBySSH boots the test guest
// with a seed that asks for no phone home, as an image without cloud-init
// would behave: Boot narrates waiting for cloud-init with the address
// known, then calls it ready by ssh once its port 22 greets. The guest
// resolves a name served inside the test namespace through the forwarder
// on the bridge, and the engine's view reports the login user it was
// seeded with.
func TestAGuestWithoutCloudInitResolvesAndIsReadyBySSH(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		dir, _, _ := netnsEnv(t)
		const id, name = "vm-e2e-nocloud", "nocloud-1"
		killLeftovers(t, dir, id)
		ctx := context.Background()
		log := hosttest.Logger(t)
		want := netip.MustParseAddr("192.0.2.77")
		network, err := netsetup.Setup(ctx, netsetup.Config{
			Bridge: testBridge, Prefix: netip.MustParsePrefix("10.78.4.1/24"), Teardown: true,
			LeaseFile: filepath.Join(dir, "leases.json"), Log: log,
			DNSUpstreams: []netip.AddrPort{netnstest.ServeName(t, "probe.eitri.test", want)},
		})
		require.NoError(t, err)
		t.Cleanup(func() { network.Close() })
		qb, err := qemu.New(qemu.Config{Dir: filepath.Join(dir, "vms"), Log: log})
		require.NoError(t, err)
		st, err := state.Open(filepath.Join(dir, "state"))
		require.NoError(t, err)
		// The fallback is due as soon as the guest has its address.
		hv, err := New(Config{QEMU: qb, Net: network, St: st, AddressWait: readyWithin, SSHFallbackAfter: time.Second, Log: log})
		require.NoError(t, err)

		spec := state.VMSpec{ID: id, Name: name, VCPUs: 1, MemMB: 256, DiskGB: 1}
		require.NoError(t, hv.PrepareRootDisk(ctx, spec, guestImage(t)))
		require.NoError(t, seed.Write(st.SeedPath(id), seed.Params{InstanceID: id, Hostname: name, LoginUser: "eitri"}))

		bootCtx, cancel := context.WithTimeout(ctx, readyWithin)
		defer cancel()
		require.NoError(t, hv.Boot(bootCtx, spec, st.SeedPath(id)))
		signal, ready := hv.Ready(ctx, id, state.ReadinessDefault)
		require.True(t, ready)
		assert.Equal(t, SignalSSH, signal, "no phone home came; sshd answered")
		_, phoned := network.PhonedHomeAt(id)
		assert.False(t, phoned)
		addr, ok := hv.Address(ctx, id)
		require.True(t, ok)

		client := &http.Client{Timeout: 20 * time.Second}
		resp, err := client.Get("http://" + addr.String() + "/resolve?name=probe.eitri.test")
		require.NoError(t, err)
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "guest says: %s", body)
		assert.Equal(t, want.String(), strings.TrimSpace(string(body)), "the guest resolved through the bridge")

		resp, err = client.Get("http://" + addr.String() + "/resolve?name=missing.eitri.test")
		require.NoError(t, err)
		resp.Body.Close()
		assert.Equal(t, http.StatusBadGateway, resp.StatusCode, "an unknown name stays unknown")
	})
}
