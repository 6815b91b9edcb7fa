package hostvm

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/netnstest"
	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/reconcile"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

const (
	// imageEnv overrides where the guest image is read from.
	imageEnv     = "EITRI_GUEST_IMAGE"
	defaultImage = "/tmp/gout/eitri-guest.raw"
	// A bridge name and prefix no dev instance uses, though each test has
	// its own namespace anyway.
	testBridge = "eitritest0"

	// Liveness bounds, not speed goals: a TCG boot takes seconds.
	readyWithin   = 90 * time.Second
	stoppedWithin = 60 * time.Second
)

// guestImage is the tiny test guest, or a skip saying how to build it.
func guestImage(t *testing.T) string {
	t.Helper()
	path := os.Getenv(imageEnv)
	if path == "" {
		path = defaultImage
	}
	if _, err := os.Stat(path); err != nil {
		t.Skipf("no guest image at %s (build one with guestimage/build.sh /tmp/gout, or set %s)", path, imageEnv)
	}
	return path
}

// host is one agent's worth of building blocks over a directory, as the
// agent binary wires them.
type host struct {
	dir   string
	net   *netsetup.Network
	qemu  *qemu.Backend
	st    *state.Store
	hyper *Hypervisor
	eng   *reconcile.Engine
}

func (h *host) qemuDir() string  { return filepath.Join(h.dir, "vms") }
func (h *host) stateDir() string { return filepath.Join(h.dir, "state") }

// hostOption adjusts the QEMU backend or the engine startHost builds.
type hostOption func(*qemu.Config, *reconcile.Config)

// startHost builds a Hypervisor and a reconcile engine over dir. teardown
// says whether closing it removes the bridge (the last agent of a test).
func startHost(t *testing.T, dir string, prefix netip.Prefix, teardown bool, opts ...hostOption) *host {
	t.Helper()
	ctx := context.Background()
	log := hosttest.Logger(t)
	h := &host{dir: dir}
	var err error
	h.net, err = netsetup.Setup(ctx, netsetup.Config{
		Bridge: testBridge, Prefix: prefix, LeaseFile: filepath.Join(dir, "leases.json"),
		Teardown: teardown, Log: log,
	})
	require.NoError(t, err)
	qcfg := qemu.Config{Dir: h.qemuDir(), Log: log, ShutdownGrace: 20 * time.Second}
	ecfg := reconcile.Config{VMTimeout: 2 * time.Minute, ResyncInterval: 300 * time.Millisecond, Log: log}
	for _, o := range opts {
		o(&qcfg, &ecfg)
	}
	h.qemu, err = qemu.New(qcfg)
	require.NoError(t, err)
	h.st, err = state.Open(h.stateDir())
	require.NoError(t, err)
	images := NewImages(imagecache.New(filepath.Join(dir, "images"), imagecache.WithLogger(log), allowLoopback))
	h.hyper, err = New(Config{QEMU: h.qemu, Net: h.net, St: h.st, Images: images, AddressWait: readyWithin, Log: log})
	require.NoError(t, err)
	ecfg.Hyper, ecfg.Images, ecfg.Seed, ecfg.St = h.hyper, images.Resolve, h.hyper.WriteSeed, h.st
	h.eng, err = reconcile.New(ecfg)
	require.NoError(t, err)
	return h
}

// stop ends this agent the way a restart does: engine and DHCP server go,
// guests stay.
func (h *host) stop(t *testing.T) {
	h.eng.Close()
	require.NoError(t, h.net.Close())
}

// netnsEnv prepares what every test inside the namespace needs: loopback
// up, the image served over loopback HTTP, a directory, and a guard that
// kills any QEMU the test leaves (the namespace outlives no process).
func netnsEnv(t *testing.T) (dir, url, sha string) {
	t.Helper()
	lo, err := netlink.LinkByName("lo")
	require.NoError(t, err)
	require.NoError(t, netlink.LinkSetUp(lo))

	path := guestImage(t)
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	sum := sha256.Sum256(data)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.ServeContent(w, r, "guest.raw", time.Time{}, bytes.NewReader(data))
	}))
	t.Cleanup(ts.Close)

	dir = t.TempDir()
	return dir, ts.URL + "/guest.raw", hex.EncodeToString(sum[:])
}

// killLeftovers stops any QEMU still running under dir's backend when the
// test ends, however it ends.
func killLeftovers(t *testing.T, dir string, ids ...string) {
	t.Cleanup(func() {
		b, err := qemu.New(qemu.Config{Dir: filepath.Join(dir, "vms")})
		if err != nil {
			return
		}
		for _, id := range ids {
			_ = b.Kill(context.Background(), id)
		}
	})
}

func snapshot(gen uint64, vms ...*eitriv1.VMDesired) *eitriv1.DesiredStateSnapshot {
	return &eitriv1.DesiredStateSnapshot{Generation: gen, Vms: vms}
}

func desiredVM(id, name, url, sha, power string) *eitriv1.VMDesired {
	return &eitriv1.VMDesired{
		VmId: id, Name: name, ImageUrl: url, ImageSha256: sha,
		Vcpus: 1, MemMb: 256, DiskGb: 1, PowerState: power,
	}
}

func rowOf(rep *eitriv1.ActualStateReport, id string) *eitriv1.ActualVM {
	for _, r := range rep.GetVms() {
		if r.GetVmId() == id {
			return r
		}
	}
	return nil
}

// waitRow waits until the VM's report row satisfies ok and returns it; on
// timeout it fails with the last row seen and the guest's console.
func waitRow(t *testing.T, h *host, id string, within time.Duration, what string, ok func(*eitriv1.ActualVM) bool) *eitriv1.ActualVM {
	t.Helper()
	deadline := time.Now().Add(within)
	var last *eitriv1.ActualVM
	for time.Now().Before(deadline) {
		last = rowOf(h.eng.Report(), id)
		if last != nil && ok(last) {
			return last
		}
		select {
		case <-h.eng.Changed():
		case <-time.After(200 * time.Millisecond):
		}
	}
	t.Fatalf("vm %s not %s within %s; last row: %v\nserial:\n%s", id, what, within, last, h.hyper.SerialTail(id))
	return nil
}

func isReady(r *eitriv1.ActualVM) bool {
	return r.GetPhase() == "ready" && r.GetPower() == "running" && r.GetIp() != ""
}

// getHostname asks the guest's HTTP server who it is.
func getHostname(t *testing.T, ip string) string {
	t.Helper()
	client := &http.Client{Timeout: 5 * time.Second}
	var body string
	// The guest leases before its HTTP server listens.
	require.Eventually(t, func() bool {
		resp, err := client.Get("http://" + ip + ":80/")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		body = string(b)
		return err == nil && resp.StatusCode == http.StatusOK
	}, 30*time.Second, 250*time.Millisecond, "guest HTTP server at %s", ip)
	return body
}

func TestEngineRunsRealVMLifecycle(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		dir, url, sha := netnsEnv(t)
		const id, name = "vm-e2e-1", "web-1"
		killLeftovers(t, dir, id)
		h := startHost(t, dir, netip.MustParsePrefix("10.78.1.1/24"), true)
		t.Cleanup(func() { h.stop(t) })

		start := time.Now()
		require.True(t, h.eng.Apply(snapshot(1, desiredVM(id, name, url, sha, "running"))))
		row := waitRow(t, h, id, readyWithin, "ready", isReady)
		t.Logf("ready after %s with ip %s", time.Since(start).Round(100*time.Millisecond), row.GetIp())
		ip := netip.MustParseAddr(row.GetIp())
		assert.True(t, netip.MustParsePrefix("10.78.1.0/24").Contains(ip), "address from the test prefix")
		assert.Empty(t, row.GetLastError())
		assert.Empty(t, row.GetStatusDetail(), "a settled VM has nothing to add")
		assert.NotEmpty(t, row.GetSshHostPubkey())
		assert.Equal(t, "cloud-init", row.GetReadySignal(), "the guest phoned home, as cloud-init does")
		assert.Equal(t, reconcile.DefaultLoginUser, row.GetLoginUser())
		assert.Equal(t, "qcow2", diskFormatOf(t, h.hyper.RootDisk(id)))

		body := getHostname(t, row.GetIp())
		assert.Contains(t, body, "hostname="+name, "the guest named itself from the seed")
		assert.Contains(t, body, "instance-id="+id)

		// Stop.
		start = time.Now()
		require.True(t, h.eng.Apply(snapshot(2, desiredVM(id, name, url, sha, "stopped"))))
		row = waitRow(t, h, id, stoppedWithin, "stopped", func(r *eitriv1.ActualVM) bool {
			return r.GetPhase() == "stopped" && r.GetPower() == "stopped"
		})
		t.Logf("stopped after %s", time.Since(start).Round(100*time.Millisecond))
		_, alive := h.qemu.PID(id)
		assert.False(t, alive, "no QEMU once stopped")
		assert.Contains(t, h.hyper.SerialTail(id), "EITRI-GUEST-POWEROFF", "the guest powered off cleanly (ACPI)")
		assert.FileExists(t, h.hyper.RootDisk(id), "a stopped VM keeps its disk")

		// Delete, with the destroy time already passed.
		start = time.Now()
		del := desiredVM(id, name, url, sha, "stopped")
		del.Deleted, del.DestroyAtUnix = true, time.Now().Add(-time.Minute).Unix()
		del.Destroy = true // the control plane's clock passed destroy_at
		require.True(t, h.eng.Apply(snapshot(3, del)))
		require.Eventually(t, func() bool {
			rep := h.eng.Report()
			return slices.Contains(rep.GetDestroyed(), id) && rowOf(rep, id) == nil
		}, stoppedWithin, 100*time.Millisecond, "vm reported destroyed")
		t.Logf("destroyed after %s", time.Since(start).Round(100*time.Millisecond))

		assertNothingLeft(t, h, id)
	})
}

// assertNothingLeft checks every place a VM occupies on the host.
func assertNothingLeft(t *testing.T, h *host, id string) {
	t.Helper()
	ents, err := os.ReadDir(h.qemuDir())
	require.NoError(t, err)
	assert.Empty(t, ents, "QEMU's directory (disk, logs, sockets) is gone")
	ents, err = os.ReadDir(filepath.Join(h.stateDir(), "data"))
	require.NoError(t, err)
	assert.Empty(t, ents, "the VM's data directory (seed) is gone")
	ids, err := h.st.ListVMs()
	require.NoError(t, err)
	assert.Empty(t, ids, "the VM's record is gone")

	_, err = netlink.LinkByName(netsetup.TapName(id))
	var notFound netlink.LinkNotFoundError
	assert.True(t, errors.As(err, &notFound), "tap %s removed, got %v", netsetup.TapName(id), err)

	addr, _ := h.net.Leased(id)
	assert.False(t, addr.IsValid(), "the address is released")
	leases, err := os.ReadFile(filepath.Join(h.dir, "leases.json"))
	require.NoError(t, err)
	assert.NotContains(t, string(leases), id, "the lease file forgot the VM")
}

func diskFormatOf(t *testing.T, path string) string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	magic := make([]byte, 4)
	_, err = io.ReadFull(f, magic)
	require.NoError(t, err)
	if string(magic) == "QFI\xfb" {
		return "qcow2"
	}
	return "raw"
}

// TestAgentRestartAdoptsRunningVM: a new agent (engine, Hypervisor, QEMU
// backend, network) over the same directories finds the guest running and
// reports it ready without booting it again.
func TestAgentRestartAdoptsRunningVM(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		dir, url, sha := netnsEnv(t)
		const id, name = "vm-e2e-restart", "restart-1"
		killLeftovers(t, dir, id)
		prefix := netip.MustParsePrefix("10.78.2.1/24")
		snap := snapshot(7, desiredVM(id, name, url, sha, "running"))

		first := startHost(t, dir, prefix, false)
		require.True(t, first.eng.Apply(snap))
		row := waitRow(t, first, id, readyWithin, "ready", isReady)
		pid, ok := first.qemu.PID(id)
		require.True(t, ok)
		// The guest prints its ready line just after the lease lands.
		readyLines := func(h *host) int { return strings.Count(h.qemu.SerialTail(id, 10000), "EITRI-GUEST-READY") }
		require.Eventually(t, func() bool { return readyLines(first) == 1 }, 30*time.Second, 100*time.Millisecond, "one boot so far")
		boots := readyLines(first)
		first.stop(t)

		start := time.Now()
		second := startHost(t, dir, prefix, true)
		t.Cleanup(func() { second.stop(t) })
		require.True(t, second.eng.Apply(snap))
		again := waitRow(t, second, id, readyWithin, "ready", isReady)
		t.Logf("adopted and ready after %s", time.Since(start).Round(time.Millisecond))
		assert.Equal(t, row.GetIp(), again.GetIp())
		assert.Equal(t, row.GetSshHostPubkey(), again.GetSshHostPubkey())
		assert.Equal(t, "cloud-init", again.GetReadySignal(), "the phone home outlived the agent")

		// Let a few resync passes run: none may boot it.
		time.Sleep(5 * 300 * time.Millisecond)
		pidAfter, ok := second.qemu.PID(id)
		require.True(t, ok, "still running")
		assert.Equal(t, pid, pidAfter, "the same QEMU, not a new one")
		assert.Equal(t, boots, readyLines(second), "the guest did not reboot")
		assert.Contains(t, getHostname(t, again.GetIp()), "hostname="+name, "the adopted guest still serves")

		// The new agent can also stop what it adopted.
		require.NoError(t, second.hyper.Shutdown(context.Background(), id))
		running, err := second.hyper.Power(context.Background(), id)
		require.NoError(t, err)
		assert.False(t, running)
	})
}

// TestBootTimeoutsCarrySerialTail: with the DHCP server down, a guest
// boots, prints to its console and never takes an address. A Boot whose
// context ends first says so with the console's last lines and leaves the
// guest booting for the next attempt; AddressWait running out kills the
// guest, and the engine's last_error for the failed VM carries the console.
func TestBootTimeoutsCarrySerialTail(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		dir, url, sha := netnsEnv(t)
		const id, name = "vm-e2e-silent", "silent-1"
		killLeftovers(t, dir, id)
		ctx := context.Background()
		log := hosttest.Logger(t)
		// The bridge and taps stay after Close; only DHCP is gone.
		net, err := netsetup.Setup(ctx, netsetup.Config{
			Bridge: testBridge, Prefix: netip.MustParsePrefix("10.78.3.1/24"),
			LeaseFile: filepath.Join(dir, "leases.json"), Log: log,
		})
		require.NoError(t, err)
		require.NoError(t, net.Close())
		qb, err := qemu.New(qemu.Config{Dir: filepath.Join(dir, "vms"), Log: log})
		require.NoError(t, err)
		st, err := state.Open(filepath.Join(dir, "state"))
		require.NoError(t, err)

		// Boot by hand, giving up once the guest is visibly asking for an
		// address: a deterministic stand-in for a pass running out of time.
		hv, err := New(Config{QEMU: qb, Net: net, St: st, AddressWait: time.Hour, Log: log})
		require.NoError(t, err)
		spec := state.VMSpec{ID: id, Name: name, VCPUs: 1, MemMB: 256, DiskGB: 1}
		require.NoError(t, hv.PrepareRootDisk(ctx, spec, guestImage(t)))
		require.NoError(t, hv.WriteSeed(st.SeedPath(id), reconcile.SeedParams{InstanceID: id, Hostname: name}))
		bootCtx, giveUp := context.WithCancel(ctx)
		go func() {
			defer giveUp()
			for bootCtx.Err() == nil && !strings.Contains(hv.SerialTail(id), "udhcpc: broadcasting discover") {
				time.Sleep(100 * time.Millisecond)
			}
		}()
		err = hv.Boot(bootCtx, spec, st.SeedPath(id))
		require.Error(t, err)
		t.Logf("boot error: %v", err)
		assert.ErrorIs(t, err, context.Canceled, "the caller's context ended the wait")
		assert.Contains(t, err.Error(), "no address yet after")
		assert.Contains(t, err.Error(), "; serial console:\n")
		assert.Contains(t, err.Error(), "udhcpc: broadcasting discover")
		pid, ok := qb.PID(id)
		require.True(t, ok, "the guest keeps booting after its caller gave up")

		short, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
		err = hv.Boot(short, spec, st.SeedPath(id))
		cancel()
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		again, ok := qb.PID(id)
		require.True(t, ok)
		assert.Equal(t, pid, again, "a second Boot waits on the same QEMU")

		// Through the engine, with AddressWait shorter than any pass: the
		// create fails (one attempt allowed), the guest is killed, and
		// last_error ends with the console.
		hv2, err := New(Config{QEMU: qb, Net: net, St: st, AddressWait: 2 * time.Second, Log: log})
		require.NoError(t, err)
		images := NewImages(imagecache.New(filepath.Join(dir, "images"), imagecache.WithLogger(log), allowLoopback))
		eng, err := reconcile.New(reconcile.Config{
			Hyper: hv2, Images: images.Resolve, Seed: hv2.WriteSeed, St: st,
			VMTimeout: time.Minute, MaxCreateAttempts: 1, ResyncInterval: 300 * time.Millisecond, Log: log,
		})
		require.NoError(t, err)
		t.Cleanup(eng.Close)
		h := &host{hyper: hv2, eng: eng}
		require.True(t, eng.Apply(snapshot(1, desiredVM(id, name, url, sha, "running"))))
		row := waitRow(t, h, id, readyWithin, "failed", func(r *eitriv1.ActualVM) bool {
			return r.GetPhase() == "failed"
		})
		t.Logf("last_error: %s", row.GetLastError())
		assert.Contains(t, row.GetLastError(), "took no address within 2s; serial console:\n")
		assert.Contains(t, row.GetLastError(), "udhcpc: broadcasting discover")
		assert.True(t, strings.HasSuffix(row.GetLastError(), hv2.SerialTail(id)), "the error ends with the console's last lines")
		assert.Equal(t, "stopped", row.GetPower())
		_, alive := qb.PID(id)
		assert.False(t, alive, "a failed VM holds no QEMU")

		eng.Close() // no pass may race the cleanup
		require.NoError(t, hv2.Destroy(ctx, id))
		_, err = os.Stat(qb.VMDir(id))
		assert.True(t, os.IsNotExist(err), "destroyed: no VM directory")
	})
}

// inNetns runs body in its own network namespace (bridge, taps, NAT, DHCP
// and QEMU all live there).
func inNetns(t *testing.T, body func(t *testing.T)) {
	hosttest.NeedQEMU(t)
	guestImage(t)
	netnstest.Run(t, 270*time.Second, "creates a network namespace with a bridge, taps, nftables rules and QEMU guests", body)
}
