package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/agent/netnstest"
	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/seed/seedtest"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// inNetns re-runs the calling test inside a network namespace it creates
// and removes, so the bridge, taps, NAT and DHCP of a real dev instance touch
// nothing on the machine. It returns true in the child, where the test runs.
func inNetns(t *testing.T) bool {
	if netnstest.Inside(t) {
		return true
	}
	if os.Getenv("EITRI_GUEST_IMAGE") == "" {
		t.Skip("EITRI_GUEST_IMAGE is not set: build the test guest with `make guest-image` (make test does)")
	}
	for _, bin := range []string{"qemu-system-x86_64", "qemu-img"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("%s not installed (make deps installs it)", bin)
		}
	}
	netnstest.Run(t, 10*time.Minute, "the agent makes a bridge, taps and NAT (inside a test network namespace)", func(*testing.T) {})
	return false
}

// slowImage serves a file with a declared length, slowly enough that the
// download is seen in progress.
func slowImage(t *testing.T, path string) (url, sum string) {
	t.Helper()
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	// Pad the small test disk past the 32 MiB progress step, so the create
	// has a number to narrate (zeros after the partition change nothing).
	const size = 72 << 20
	if len(data) < size {
		data = append(data, make([]byte, size-len(data))...)
	}
	s := sha256.Sum256(data)
	mux := http.NewServeMux()
	mux.HandleFunc("/guest.raw", func(w http.ResponseWriter, r *http.Request) { servePaced(w, data) })
	srv := &http.Server{Handler: mux}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String() + "/guest.raw", hex.EncodeToString(s[:])
}

// servePaced writes data with its length declared, 4 MiB every 100 ms:
// slow enough that a download's progress is seen, whoever watches.
func servePaced(w http.ResponseWriter, data []byte) {
	w.Header().Set("Content-Length", strconv.Itoa(len(data)))
	const chunk = 4 << 20
	for off := 0; off < len(data); off += chunk {
		if _, err := w.Write(data[off:min(off+chunk, len(data))]); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		time.Sleep(100 * time.Millisecond)
	}
}

type devInstance struct {
	cancel context.CancelFunc
	done   chan error
}

func startDev(t *testing.T, dir string) *devInstance {
	t.Helper()
	return startDevWith(t, dir)
}

// startDevWith starts the test's dev instance with extra flags after the
// defaults (a repeated single-valued flag takes the later value).
func startDevWith(t *testing.T, dir string, extra ...string) *devInstance {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	d := &devInstance{cancel: cancel, done: make(chan error, 1)}
	args := []string{"dev", "--listen", "127.0.0.1:18080", "--data-dir", dir,
		"--bridge", "eitrie2e0", "--subnet", "10.79.0.1/24", "--vm-timeout", "3m", "--delete-grace", "2s", "--log-level", "warn",
		// A failing create spends its budget in seconds, not minutes.
		"--retry-backoff", "1s",
		// slowImage serves on loopback, which image downloads refuse unless allowed.
		"--image-allow", "127.0.0.1/32"}
	go func() {
		d.done <- execute(ctx, append(args, extra...), cli.IO{In: strings.NewReader(""), Out: io.Discard, Err: os.Stderr})
	}()
	require.Eventually(t, func() bool {
		resp, err := http.Get("http://127.0.0.1:18080/healthz")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == 200
	}, 30*time.Second, 50*time.Millisecond)
	return d
}

// vms is an admin's VM client for the instance, returned once its local
// host has enrolled and reported its capacity (VMs can be placed).
func (d *devInstance) vms(t *testing.T, dir string) eitriv1connect.VMServiceClient {
	t.Helper()
	tokenBytes, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	hc := connclient.HTTPClient("")
	base := "http://127.0.0.1:18080"
	auth := connect.WithInterceptors(connclient.Bearer(strings.TrimSpace(string(tokenBytes))))
	require.Eventually(t, func() bool {
		r, err := eitriv1connect.NewHostServiceClient(hc, base, auth).ListHosts(context.Background(), connect.NewRequest(&eitriv1.ListHostsRequest{}))
		return err == nil && len(r.Msg.Hosts) == 1 && r.Msg.Hosts[0].Capacity != nil
	}, 90*time.Second, 100*time.Millisecond, "the local agent enrolls and reports its capacity (after proving its accelerator)")
	return eitriv1connect.NewVMServiceClient(hc, base, auth)
}

func (d *devInstance) stop(t *testing.T) {
	d.cancel()
	select {
	case err := <-d.done:
		require.NoError(t, err)
	case <-time.After(60 * time.Second):
		t.Fatal("eitri dev did not stop")
	}
}

type sighting struct{ lifecycle, detail, ip, power string }

// sightings is every distinct state of a VM a WatchVMs stream pushed, in
// the order pushed.
type sightings struct {
	mu  sync.Mutex
	all []sighting
}

// watchSightings records what WatchVMs pushes until ctx ends.
func watchSightings(ctx context.Context, t *testing.T, vms eitriv1connect.VMServiceClient) *sightings {
	t.Helper()
	stream, err := vms.WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	w := &sightings{}
	go func() {
		for stream.Receive() {
			if v := stream.Msg().GetChanged(); v != nil {
				w.add(sighting{v.Lifecycle, v.StatusDetail, v.AssignedIp, v.ActualPower})
			}
		}
	}()
	return w
}

func (w *sightings) add(s sighting) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.all) == 0 || w.all[len(w.all)-1] != s {
		w.all = append(w.all, s)
	}
}

// last is the newest sighting, zero before any.
func (w *sightings) last() sighting {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.all) == 0 {
		return sighting{}
	}
	return w.all[len(w.all)-1]
}

// list is a copy of every sighting so far.
func (w *sightings) list() []sighting {
	w.mu.Lock()
	defer w.mu.Unlock()
	return append([]sighting(nil), w.all...)
}

func TestDevModeRunsARealVMEndToEnd(t *testing.T) {
	if !inNetns(t) {
		return
	}
	dir := t.TempDir()
	imgURL, imgSum := slowImage(t, os.Getenv("EITRI_GUEST_IMAGE"))
	dev := startDev(t, dir)
	defer func() { dev.stop(t) }()
	tokenBytes, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	token := strings.TrimSpace(string(tokenBytes))
	base := "http://127.0.0.1:18080"
	hc := connclient.HTTPClient("")
	vms := eitriv1connect.NewVMServiceClient(hc, base, connect.WithInterceptors(connclient.Bearer(token)))
	ctx := context.Background()

	require.Eventually(t, func() bool {
		r, err := eitriv1connect.NewHostServiceClient(hc, base, connect.WithInterceptors(connclient.Bearer(token))).
			ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
		return err == nil && len(r.Msg.Hosts) == 1 && r.Msg.Hosts[0].Capacity != nil
	}, 90*time.Second, 100*time.Millisecond, "the local agent enrolls and reports its capacity (after proving its accelerator)")

	// Watch first, so every step of the create is seen as it is pushed.
	watchCtx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	watched := watchSightings(watchCtx, t, vms)
	last := watched.last

	// Create through the Connect JSON API, as curl would.
	body, _ := json.Marshal(map[string]any{"name": "web-1", "image_url": imgURL, "image_sha256": imgSum, "vcpus": 1, "mem_mb": 256, "disk_gb": 1})
	req, _ := http.NewRequest(http.MethodPost, base+"/eitri.v1.VMService/CreateVM", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	require.Equal(t, 200, resp.StatusCode, string(raw))
	var created struct{ Vm struct{ Id string } }
	require.NoError(t, json.Unmarshal(raw, &created))
	id := created.Vm.Id

	// Publish ports while the VM is still being created: a caller now has
	// nowhere to go, and that is counted as dropped, pushed to a watcher.
	exps := eitriv1connect.NewExposureServiceClient(hc, base, connect.WithInterceptors(connclient.Bearer(token)))
	httpExp, err := exps.CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{VmId: id, GuestPort: 80, Scope: "local", MaxSessions: 1}))
	require.NoError(t, err)
	udpExp, err := exps.CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{VmId: id, GuestPort: 7, Protocol: "udp", Scope: "local"}))
	require.NoError(t, err)
	var xmu sync.Mutex
	counters := map[string]*eitriv1.ExposureSessions{}
	xstream, err := exps.WatchExposures(watchCtx, connect.NewRequest(&eitriv1.WatchExposuresRequest{VmId: id}))
	require.NoError(t, err)
	go func() {
		for xstream.Receive() {
			xmu.Lock()
			if x := xstream.Msg().GetChanged(); x != nil {
				counters[x.Id] = x.Sessions
			}
			for _, x := range xstream.Msg().GetSnapshot().GetExposures() {
				counters[x.Id] = x.Sessions
			}
			xmu.Unlock()
		}
	}()
	sessionsOf := func(id string) *eitriv1.ExposureSessions {
		xmu.Lock()
		defer xmu.Unlock()
		return counters[id]
	}
	hostAddr := func(x *eitriv1.Exposure) string {
		return net.JoinHostPort("127.0.0.1", strconv.Itoa(int(x.HostPort)))
	}
	require.Eventually(t, func() bool {
		if c, err := net.DialTimeout("tcp", hostAddr(httpExp.Msg.Exposure), time.Second); err == nil {
			_, _ = c.Read(make([]byte, 1))
			c.Close()
		}
		return sessionsOf(httpExp.Msg.Exposure.Id).GetDropped() > 0
	}, time.Minute, 200*time.Millisecond, "a caller before the guest has an address is dropped, and the watcher hears of it")

	require.Eventually(t, func() bool { s := last(); return s.lifecycle == "ready" && s.ip != "" }, 4*time.Minute, 100*time.Millisecond,
		"the VM becomes ready with an address")
	ready := last()
	assert.Empty(t, ready.detail, "a settled VM says nothing more")

	// The agent had the guest's host key certified by the control plane's
	// host CA before it wrote the seed.
	got, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
	require.NoError(t, err)
	hostKey, _, _, _, err := ssh.ParseAuthorizedKey([]byte(got.Msg.Vm.SshHostPubkey))
	require.NoError(t, err, "the host key is reported")
	evs, err := vms.ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: id}))
	require.NoError(t, err)
	certified := false
	for _, ev := range evs.Msg.Events {
		certified = certified || ev.Kind == "ssh-host-cert" && strings.Contains(ev.Message, ssh.FingerprintSHA256(hostKey))
	}
	assert.True(t, certified, "the guest's host key was certified: %v", evs.Msg.Events)
	// And its seed carries that certificate and the user CA, for sshd.
	seeds, _ := filepath.Glob(filepath.Join(dir, "agent", "state", "*", id, "seed.iso"))
	require.Len(t, seeds, 1, "the VM's seed on its host")
	userData := isoFile(t, seeds[0], "user-data")
	cas, err := eitriv1connect.NewSSHServiceClient(hc, base, connect.WithInterceptors(connclient.Bearer(token))).
		GetSSHCAKeys(ctx, connect.NewRequest(&eitriv1.GetSSHCAKeysRequest{}))
	require.NoError(t, err)
	assert.Contains(t, userData, cas.Msg.UserCaKeys[0].PublicKey, "the guest trusts the user CA")
	assert.Contains(t, userData, "TrustedUserCAKeys /etc/ssh/")
	assert.Contains(t, userData, "HostCertificate /etc/ssh/")
	assert.Contains(t, userData, "ssh-ed25519-cert-v01@openssh.com ", "the host certificate is in the seed")

	var details []string
	for _, s := range watched.list() {
		if s.lifecycle == "creating" && s.detail != "" && (len(details) == 0 || details[len(details)-1] != s.detail) {
			details = append(details, s.detail)
		}
	}
	t.Logf("narration seen: %q", details)
	assertNarratedInOrder(t, details, createNarration)

	// The guest answers on its address with its own name.
	get := func() (string, error) {
		c := &http.Client{Timeout: 3 * time.Second}
		r, err := c.Get("http://" + ready.ip + "/")
		if err != nil {
			return "", err
		}
		defer r.Body.Close()
		b, err := io.ReadAll(r.Body)
		return string(b), err
	}
	require.Eventually(t, func() bool { b, err := get(); return err == nil && strings.Contains(b, "hostname=web-1") }, 30*time.Second, 200*time.Millisecond)

	// The published ports carry traffic: HTTP over TCP, echo over UDP.
	require.Eventually(t, func() bool {
		// No keep-alive: an idle pooled connection would hold the port's one
		// slot and turn the cap check below into a race.
		c := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
		r, err := c.Get("http://" + hostAddr(httpExp.Msg.Exposure) + "/")
		if err != nil {
			return false
		}
		defer r.Body.Close()
		b, _ := io.ReadAll(r.Body)
		return strings.Contains(string(b), "hostname=web-1")
	}, 30*time.Second, 200*time.Millisecond, "HTTP through the published port")
	uc, err := net.Dial("udp", hostAddr(udpExp.Msg.Exposure))
	require.NoError(t, err)
	_ = uc.SetDeadline(time.Now().Add(5 * time.Second))
	_, err = uc.Write([]byte("ping-7"))
	require.NoError(t, err)
	buf := make([]byte, 64)
	n, err := uc.Read(buf)
	require.NoError(t, err, "UDP echo through the published port")
	assert.Equal(t, "ping-7", string(buf[:n]))
	uc.Close()

	// At a cap of one, a held connection plus one more: 1 open, 1 refused,
	// pushed to the watcher without asking.
	require.Eventually(t, func() bool { return sessionsOf(httpExp.Msg.Exposure.Id).GetActive() == 0 }, 10*time.Second, 50*time.Millisecond,
		"the HTTP checks above left nothing open")
	// The watcher can say 0 before the proxy has let go of the last check's
	// session (reports trail by up to a report interval), so a first caller
	// may still be turned away: one that is closed at once was refused, one
	// left open holds the slot.
	var held net.Conn
	require.Eventually(t, func() bool {
		c, err := net.Dial("tcp", hostAddr(httpExp.Msg.Exposure))
		if err != nil {
			return false
		}
		_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, os.ErrDeadlineExceeded) {
			c.Close()
			return false
		}
		_ = c.SetReadDeadline(time.Time{})
		held = c
		return true
	}, 10*time.Second, 200*time.Millisecond, "a caller holds the port's one slot")
	defer held.Close()
	// Refusals before the slot was held land in the same report as active 1
	// or an earlier one, so the count read with active 1 is the baseline.
	var refusedBefore int64
	require.Eventually(t, func() bool {
		s := sessionsOf(httpExp.Msg.Exposure.Id)
		refusedBefore = s.GetRefused()
		return s.GetActive() == 1
	}, 10*time.Second, 50*time.Millisecond)
	extra, err := net.Dial("tcp", hostAddr(httpExp.Msg.Exposure))
	require.NoError(t, err)
	_, _ = extra.Read(make([]byte, 1))
	extra.Close()
	require.Eventually(t, func() bool {
		s := sessionsOf(httpExp.Msg.Exposure.Id)
		return s.GetActive() == 1 && s.GetRefused() == refusedBefore+1
	}, 10*time.Second, 50*time.Millisecond, "active 1, refused 1 more")
	held.Close()

	// An agent (and control plane) restart leaves the guest running: same
	// QEMU process, no reboot.
	pidFile := filepath.Join(dir, "agent", "vms", id, "qemu.pid")
	pidBefore, err := os.ReadFile(pidFile)
	require.NoError(t, err)
	stopWatch()
	dev.stop(t)
	dev = startDev(t, dir)
	require.Eventually(t, func() bool {
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		return err == nil && r.Msg.Vm.Lifecycle == "ready"
	}, time.Minute, 200*time.Millisecond)
	pidAfter, err := os.ReadFile(pidFile)
	require.NoError(t, err)
	assert.Equal(t, strings.TrimSpace(string(pidBefore)), strings.TrimSpace(string(pidAfter)), "the same QEMU process")
	b, err := get()
	require.NoError(t, err)
	assert.Contains(t, b, "hostname=web-1")

	// Stop, start.
	_, err = vms.StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: id}))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		return err == nil && r.Msg.Vm.ActualPower == "stopped" && r.Msg.Vm.Lifecycle == "stopped"
	}, 2*time.Minute, 200*time.Millisecond, "stop powers the guest off")
	_, err = vms.StartVM(ctx, connect.NewRequest(&eitriv1.StartVMRequest{Id: id}))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		return err == nil && r.Msg.Vm.Lifecycle == "ready" && r.Msg.Vm.ActualPower == "running"
	}, 2*time.Minute, 200*time.Millisecond, "start boots it again")

	// Delete: after the grace the host destroys it and nothing is left.
	_, err = vms.DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		return connect.CodeOf(err) == connect.CodeNotFound
	}, 2*time.Minute, 200*time.Millisecond, "the destroyed VM is forgotten")
	for _, p := range []string{filepath.Join(dir, "agent", "vms", id), filepath.Join(dir, "agent", "state", "vms", id+".json")} {
		_, err := os.Stat(p)
		assert.True(t, os.IsNotExist(err), "%s is left behind", p)
	}
	assert.Error(t, exec.Command("ip", "link", "show", netsetup.TapName(id)).Run(), "the tap is removed")
	leases, _ := os.ReadFile(filepath.Join(dir, "agent", "leases.json"))
	assert.NotContains(t, string(leases), id, "the address is released")
}

func TestABadImageFailsTheVMWithAPreciseErrorAndLeavesNothing(t *testing.T) {
	if !inNetns(t) {
		return
	}
	dir := t.TempDir()
	imgURL, imgSum := slowImage(t, os.Getenv("EITRI_GUEST_IMAGE"))
	dev := startDev(t, dir)
	defer dev.stop(t)
	vms := dev.vms(t, dir)
	ctx := context.Background()

	wrong := strings.Repeat("0", 64)
	cases := []struct {
		name, url, sha, want string
	}{
		{"wrong-digest", imgURL, wrong, "sha256 mismatch"},
		{"missing", strings.Replace(imgURL, "/guest.raw", "/nope.raw", 1), imgSum, "404"},
	}
	for _, c := range cases {
		r, err := vms.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{Name: c.name, ImageUrl: c.url, ImageSha256: c.sha, Vcpus: 1, MemMb: 256, DiskGb: 1}))
		require.NoError(t, err)
		id := r.Msg.Vm.Id
		var vm *eitriv1.VM
		require.Eventually(t, func() bool {
			g, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
			if err == nil {
				vm = g.Msg.Vm
			}
			return err == nil && vm.Lifecycle == "failed"
		}, 2*time.Minute, 100*time.Millisecond, "%s: a permanent image error fails the VM at once", c.name)
		assert.Contains(t, vm.LastError, c.want, c.name)
		assert.Empty(t, vm.StatusDetail, "a failed VM narrates nothing")
	}
	// Nothing half-downloaded or half-decoded is left in the cache.
	entries, _ := os.ReadDir(filepath.Join(dir, "agent", "images"))
	for _, e := range entries {
		assert.Failf(t, "stray file in the image cache", "%s", e.Name())
	}
}

func TestAFullDiskFailsTheVMWithAPreciseErrorAndLeavesNothing(t *testing.T) {
	if !inNetns(t) {
		return
	}
	dir := t.TempDir()
	imgURL, imgSum := slowImage(t, os.Getenv("EITRI_GUEST_IMAGE"))
	// The image cache sits on a 4 MiB filesystem; the image carries about
	// 13 MiB that are not zeros (its zeros are kept as holes, so only those
	// count against the disk).
	// `ip netns exec` gave this process its own mount namespace, so the mount
	// is seen by nothing else and goes away with it.
	images := filepath.Join(dir, "agent", "images")
	require.NoError(t, os.MkdirAll(images, 0o755))
	require.NoError(t, exec.Command("mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", images).Run())
	t.Cleanup(func() { _ = exec.Command("umount", images).Run() })

	dev := startDev(t, dir)
	defer dev.stop(t)
	vms := dev.vms(t, dir)
	ctx := context.Background()

	r, err := vms.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{Name: "full", ImageUrl: imgURL, ImageSha256: imgSum, Vcpus: 1, MemMb: 256, DiskGb: 1}))
	require.NoError(t, err)
	var vm *eitriv1.VM
	require.Eventually(t, func() bool {
		g, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: r.Msg.Vm.Id}))
		if err == nil {
			vm = g.Msg.Vm
		}
		return err == nil && vm.Lifecycle == "failed"
	}, 3*time.Minute, 200*time.Millisecond, "a full disk fails the create once its retries are spent")
	assert.Contains(t, vm.LastError, "no space left on device")
	entries, _ := os.ReadDir(images)
	for _, e := range entries {
		assert.Failf(t, "stray file in the image cache", "%s", e.Name())
	}
}

// The CLI against a real dev instance and a real guest: --wait narrates
// the create step by step, with the download measured from VM.progress,
// and ends on the address (exit 0); a create that fails is the command's
// error (exit 1).
func TestWaitFollowsARealCreate(t *testing.T) {
	if !inNetns(t) {
		return
	}
	dir := t.TempDir()
	imgURL, imgSum := slowImage(t, os.Getenv("EITRI_GUEST_IMAGE"))
	dev := startDev(t, dir)
	defer dev.stop(t)
	dev.vms(t, dir) // the local host can take VMs
	tok, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	t.Setenv("EITRI_URL", "")
	t.Setenv("EITRI_TOKEN", "")
	_, err = eitriIn("", "login", "http://127.0.0.1:18080", "--token", strings.TrimSpace(string(tok)))
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var out bytes.Buffer
	err = execute(ctx, []string{"vm", "create", "web-1", "--image", imgURL, "--sha256", imgSum, "--mem-mb", "256", "--disk-gb", "1", "--wait"},
		cli.IO{In: strings.NewReader(""), Out: &out, Err: &out})
	text := out.String()
	t.Logf("\n%s", text)
	require.NoError(t, err)
	// booting lasts a moment and may be coalesced away before a watcher
	// reads it; the steps that take time always show.
	outputtest.LinesInOrder(t, text, []string{"creating: downloading image", "download ", "creating: preparing root disk", "ready at 10.79.0."})
	assert.Regexp(t, `download \d+\.\d MiB / 72\.0 MiB \(\d+%\)`, text, "the download measured in bytes of the total, from VM.progress")
	lines := strings.Split(strings.TrimSpace(text), "\n")
	assert.Regexp(t, `ready at 10\.79\.0\.\d+$`, lines[len(lines)-1], "the address is the last line")

	// Another digest: the cache holds the first image by its digest, and
	// would not fetch the URL at all.
	out.Reset()
	err = execute(ctx, []string{"vm", "create", "missing", "--image", strings.Replace(imgURL, "/guest.raw", "/nope.raw", 1), "--sha256", strings.Repeat("1", 64), "--mem-mb", "256", "--disk-gb", "1", "--wait"},
		cli.IO{In: strings.NewReader(""), Out: &out, Err: &out})
	t.Logf("\n%s", out.String())
	require.Error(t, err)
	assert.Contains(t, err.Error(), "missing failed: ")
	assert.Contains(t, err.Error(), "404")
	assert.Contains(t, out.String(), "failed")
}

// isoFile reads one root file of a seed image.
func isoFile(t *testing.T, path, name string) string {
	t.Helper()
	_, files := seedtest.Read(t, path)
	require.Contains(t, files, name, "%s has no %s", path, name)
	return files[name]
}

// narrationStep is one step of what an agent narrates, as watchers see it.
type narrationStep struct {
	is       func(string) bool
	required bool
}

// createNarration is a create's steps in the order the agent takes them,
// up to the guest's boot. Watchers get the latest state of each VM,
// coalesced, so a step that lasts only milliseconds (the seed, the
// certificate) may be passed over; what is seen must still come in this
// order, and the long steps (the download with its sizes, booting) must be
// seen.
var createNarration = []narrationStep{
	{is: func(d string) bool { return d == "waiting for a create slot on this host" }},
	{is: func(d string) bool { return strings.HasPrefix(d, "downloading image") && !strings.Contains(d, "/") }},
	{is: func(d string) bool {
		return strings.HasPrefix(d, "downloading image ") && strings.Contains(d, "/") && strings.HasSuffix(d, " MiB")
	}, required: true},
	{is: func(d string) bool { return d == "preparing root disk" }},
	{is: func(d string) bool { return d == "certifying the SSH host key" }},
	{is: func(d string) bool { return d == "building the cloud-init seed" }},
	{is: func(d string) bool { return d == "booting" }, required: true},
}

// assertNarratedInOrder checks that the details seen (in arrival order)
// come in the order of steps, and that the required steps were seen;
// details no step names are passed over.
func assertNarratedInOrder(t *testing.T, details []string, steps []narrationStep) {
	t.Helper()
	at, seen := 0, map[int]bool{}
	for _, d := range details {
		for j := range steps {
			if steps[j].is(d) {
				assert.GreaterOrEqual(t, j, at, "%q came after a later step: %q", d, details)
				at = j
				seen[j] = true
				break
			}
		}
	}
	for j, st := range steps {
		if st.required {
			assert.True(t, seen[j], "step %d of the narration is seen: %q", j, details)
		}
	}
}
