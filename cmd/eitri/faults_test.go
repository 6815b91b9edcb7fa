package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/netsetup"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// Fault tests: the real binary (`eitri dev`, control plane and agent in one
// process) killed or raced at the worst moments, each in its own network
// namespace (inNetns).

// devBin is one run of `EITRI_BIN dev` as a subprocess, its output in a log.
type devBin struct {
	cmd  *exec.Cmd
	done chan struct{}
	log  string
}

// faultDir is a short data dir: QEMU's QMP socket path under it must fit in
// 107 bytes.
func faultDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "eitri-fault-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func faultBin(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("EITRI_BIN")
	if bin == "" {
		t.Skip("EITRI_BIN is not set: build the binary with `make build` and point EITRI_BIN at bin/eitri (make test does)")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Skipf("EITRI_BIN: %v", err)
	}
	return bin
}

// startDevBin runs `eitri dev` on dir (the flags of startDev, plus extra,
// which win) and waits for it to answer.
func startDevBin(t *testing.T, dir string, extra ...string) *devBin {
	t.Helper()
	args := []string{"dev", "--listen", "127.0.0.1:18080", "--data-dir", dir,
		"--bridge", "eitrie2e0", "--subnet", "10.79.0.1/24", "--vm-timeout", "3m", "--delete-grace", "2s", "--log-level", "info",
		"--retry-backoff", "1s", "--image-allow", "127.0.0.1/32"}
	args = append(args, extra...)
	logPath := filepath.Join(dir, "dev.log")
	lf, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	require.NoError(t, err)
	defer lf.Close()
	fmt.Fprintf(lf, "=== %s start\n", time.Now().Format(time.RFC3339Nano))
	cmd := exec.Command(faultBin(t), args...)
	cmd.Stdout, cmd.Stderr = lf, lf
	require.NoError(t, cmd.Start())
	d := &devBin{cmd: cmd, done: make(chan struct{}), log: logPath}
	go func() { _ = cmd.Wait(); close(d.done) }()
	t.Cleanup(func() {
		d.kill()
		if t.Failed() {
			b, _ := os.ReadFile(logPath)
			t.Logf("eitri dev log (tail):\n%s", lastLines(string(b), 60))
		}
	})
	require.Eventually(t, func() bool {
		select {
		case <-d.done:
			b, _ := os.ReadFile(logPath)
			t.Fatalf("eitri dev exited:\n%s", lastLines(string(b), 30))
		default:
		}
		resp, err := http.Get("http://127.0.0.1:18080/healthz")
		if err == nil {
			resp.Body.Close()
		}
		return err == nil && resp.StatusCode == 200
	}, 30*time.Second, 50*time.Millisecond)
	return d
}

// kill ends the process outright, as a crash or the OOM killer would.
func (d *devBin) kill() {
	_ = d.cmd.Process.Signal(syscall.SIGKILL)
	<-d.done
}

// throttledImage serves an image (padded with zeros to size) at about rate
// bytes a second, with an ETag and Range support (http.ServeContent), so a
// download can be resumed. Every request's Range header is recorded.
type throttledImage struct {
	data  []byte
	sum   string
	url   string
	rate  int
	mu    sync.Mutex
	seen  []string        // Range headers, "" for a whole-file request
	hold  func(off int64) // called before each chunk at offset off of a response
	etag  string
	mtime time.Time
}

func newThrottledImage(t *testing.T, size, rate int, hold func(off int64)) *throttledImage {
	t.Helper()
	data, err := os.ReadFile(os.Getenv("EITRI_GUEST_IMAGE"))
	require.NoError(t, err)
	if len(data) < size {
		data = append(data, make([]byte, size-len(data))...)
	}
	s := sha256.Sum256(data)
	img := &throttledImage{data: data, sum: hex.EncodeToString(s[:]), rate: rate, hold: hold,
		etag: `"` + hex.EncodeToString(s[:8]) + `"`, mtime: time.Now().Add(-time.Hour)}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		img.mu.Lock()
		img.seen = append(img.seen, r.Header.Get("Range"))
		img.mu.Unlock()
		w.Header().Set("ETag", img.etag)
		http.ServeContent(w, r, "guest.raw", img.mtime, &slowReader{img: img, r: bytes.NewReader(img.data), ctx: r.Context()})
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	img.url = "http://" + ln.Addr().String() + "/guest.raw"
	return img
}

func (img *throttledImage) ranges() []string {
	img.mu.Lock()
	defer img.mu.Unlock()
	return append([]string(nil), img.seen...)
}

type slowReader struct {
	img *throttledImage
	r   *bytes.Reader
	ctx context.Context
}

func (s *slowReader) Seek(off int64, whence int) (int64, error) { return s.r.Seek(off, whence) }

func (s *slowReader) Read(p []byte) (int, error) {
	if s.ctx.Err() != nil {
		return 0, s.ctx.Err()
	}
	const chunk = 256 << 10
	if len(p) > chunk {
		p = p[:chunk]
	}
	if s.img.hold != nil {
		off, _ := s.r.Seek(0, io.SeekCurrent)
		s.img.hold(off)
	}
	time.Sleep(time.Duration(len(p)) * time.Second / time.Duration(s.img.rate))
	return s.r.Read(p)
}

// qemusOf counts the QEMU processes whose command line names the VM's
// pidfile: the ones that are this VM's guest.
func qemusOf(t *testing.T, agentDir, id string) []int {
	t.Helper()
	pidFile := filepath.Join(agentDir, "vms", id, "qemu.pid")
	entries, err := os.ReadDir("/proc")
	require.NoError(t, err)
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if strings.Contains(args[0], "qemu") && strings.Contains(string(b), pidFile) {
			pids = append(pids, pid)
		}
	}
	return pids
}

// eitriTaps lists the links named as the agent names taps.
func eitriTaps(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("ip", "-o", "link").Output()
	require.NoError(t, err)
	var taps []string
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
		if strings.HasPrefix(name, "eitri") && name != "eitrie2e0" {
			taps = append(taps, name)
		}
	}
	return taps
}

func leasesOf(t *testing.T, agentDir string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(agentDir, "leases.json"))
	if os.IsNotExist(err) {
		return nil
	}
	require.NoError(t, err)
	var f struct {
		Leases []struct {
			VMID string `json:"vm_id"`
		} `json:"leases"`
	}
	require.NoError(t, json.Unmarshal(b, &f))
	var ids []string
	for _, l := range f.Leases {
		ids = append(ids, l.VMID)
	}
	return ids
}

func createFaultVM(t *testing.T, vms eitriv1connect.VMServiceClient, name, url, sum string) string {
	t.Helper()
	r, err := vms.CreateVM(context.Background(), connect.NewRequest(&eitriv1.CreateVMRequest{
		Name: name, ImageUrl: url, ImageSha256: sum, Vcpus: 1, MemMb: 256, DiskGb: 1}))
	require.NoError(t, err)
	return r.Msg.Vm.Id
}

// waitVM polls the VM until ok says so; a failed VM fails the test at once.
func waitVM(t *testing.T, vms eitriv1connect.VMServiceClient, id string, within time.Duration, what string, ok func(*eitriv1.VM) bool) *eitriv1.VM {
	t.Helper()
	var last *eitriv1.VM
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		r, err := vms.GetVM(context.Background(), connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		if err == nil {
			last = r.Msg.Vm
			if ok(last) {
				return last
			}
			if last.Lifecycle == "failed" {
				t.Fatalf("%s: the VM failed: %s", what, last.LastError)
			}
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("%s: not within %s; last seen %+v", what, within, last)
	return nil
}

func isReady(v *eitriv1.VM) bool { return v.Lifecycle == "ready" && v.AssignedIp != "" }

// An agent killed mid-download must pick the download up where its last
// checkpoint left it (an HTTP Range request), finish the VM, and leave no
// partial file in its image cache and no second QEMU.
func TestFaultAgentKilledMidDownloadResumesWithoutLeftovers(t *testing.T) {
	if !inNetns(t) {
		return
	}
	faultBin(t)
	dir := faultDir(t)
	agentDir := filepath.Join(dir, "agent")
	// 160 MiB at 32 MiB/s; the first response stops at 96 MiB (past the
	// 64 MiB checkpoint) until the agent has been killed.
	const stopAt = 96 << 20
	killed := make(chan struct{})
	reached := make(chan struct{}, 1)
	var first sync.Once
	img := newThrottledImage(t, 160<<20, 32<<20, func(off int64) {
		if off >= stopAt {
			first.Do(func() {
				reached <- struct{}{}
				<-killed
			})
		}
	})
	dev := startDevBin(t, dir)
	vms := dev.vmsClient(t, dir)
	id := createFaultVM(t, vms, "dl-1", img.url, img.sum)

	select {
	case <-reached:
	case <-time.After(2 * time.Minute):
		t.Fatal("the download never reached 96 MiB")
	}
	v := waitVM(t, vms, id, 10*time.Second, "narrated as downloading", func(v *eitriv1.VM) bool {
		return strings.HasPrefix(v.StatusDetail, "downloading image")
	})
	t.Logf("killing the agent at %q", v.StatusDetail)
	time.Sleep(time.Second) // the 64 MiB checkpoint's fsync is behind it
	dev.kill()
	close(killed)

	dev = startDevBin(t, dir)
	vms = dev.vmsClient(t, dir)
	waitVM(t, vms, id, 4*time.Minute, "the VM becomes ready after the restart", isReady)

	rs := img.ranges()
	t.Logf("requests seen by the image server (Range headers): %q", rs)
	resumed := false
	for _, r := range rs[1:] {
		if strings.HasPrefix(r, "bytes=") && !strings.HasPrefix(r, "bytes=0-") {
			resumed = true
		}
	}
	assert.True(t, resumed, "the restarted agent resumes the download with a Range request: %q", rs)
	entries, err := os.ReadDir(filepath.Join(agentDir, "images"))
	require.NoError(t, err)
	for _, e := range entries {
		assert.False(t, strings.HasSuffix(e.Name(), ".part") || strings.HasSuffix(e.Name(), ".resume"),
			"partial download left in the image cache: %s", e.Name())
	}
	assert.Len(t, qemusOf(t, agentDir, id), 1, "exactly one QEMU for the VM")
}

// An agent killed while its VM boots must, once restarted, adopt the QEMU it
// started (or replace it cleanly): never two guests, taps or leases.
func TestFaultAgentKilledMidBootLeavesOneGuestTapAndLease(t *testing.T) {
	if !inNetns(t) {
		return
	}
	faultBin(t)
	dir := faultDir(t)
	agentDir := filepath.Join(dir, "agent")
	img := newThrottledImage(t, 72<<20, 256<<20, nil)
	dev := startDevBin(t, dir)
	vms := dev.vmsClient(t, dir)
	id := createFaultVM(t, vms, "boot-1", img.url, img.sum)

	v := waitVM(t, vms, id, 3*time.Minute, "narrated as booting", func(v *eitriv1.VM) bool {
		return v.StatusDetail == "booting" || v.StatusDetail == "waiting for an address"
	})
	// Kill once QEMU has been started, so there is a guest to adopt.
	var before []int
	// QEMU daemonizes: until its pidfile names it, the process seen may be
	// the parent about to exit, not the guest.
	require.Eventually(t, func() bool {
		before = qemusOf(t, agentDir, id)
		b, err := os.ReadFile(filepath.Join(agentDir, "vms", id, "qemu.pid"))
		return len(before) == 1 && err == nil && strings.TrimSpace(string(b)) == strconv.Itoa(before[0])
	}, 30*time.Second, 10*time.Millisecond, "QEMU is started while the VM boots")
	t.Logf("killing the agent at %q, QEMU %v", v.StatusDetail, before)
	dev.kill()
	require.Len(t, before, 1, "one QEMU before the kill")

	dev = startDevBin(t, dir)
	vms = dev.vmsClient(t, dir)
	waitVM(t, vms, id, 3*time.Minute, "the VM becomes ready after the restart", isReady)

	after := qemusOf(t, agentDir, id)
	require.Len(t, after, 1, "exactly one QEMU for the VM")
	if after[0] == before[0] {
		t.Logf("the same QEMU (pid %d) was adopted", after[0])
	} else {
		t.Logf("QEMU %d was replaced by %d", before[0], after[0])
		assert.False(t, alive(before[0]), "the replaced QEMU is gone")
	}
	assert.Equal(t, after[0], qemuPID(t, agentDir, id), "the pidfile names the running QEMU")
	assert.Equal(t, []string{netsetup.TapName(id)}, eitriTaps(t), "exactly one tap, the VM's")
	assert.Equal(t, []string{id}, leasesOf(t, agentDir), "exactly one lease, the VM's")
}

// A start racing a delete, and a restore racing the destroy at the end of
// the grace: each call either wins or gets FailedPrecondition, and the VM is
// never left blank or half-restored.
func TestFaultDeleteRacingStartAndRestoreRacingDestroyNeverLeaveABlankVM(t *testing.T) {
	if !inNetns(t) {
		return
	}
	faultBin(t)
	dir := faultDir(t)
	agentDir := filepath.Join(dir, "agent")
	img := newThrottledImage(t, 72<<20, 256<<20, nil)
	// A 5 s grace closes restores 0.5 s before destroy_at.
	const grace = 5 * time.Second
	dev := startDevBin(t, dir, "--delete-grace", grace.String())
	vms := dev.vmsClient(t, dir)
	ctx := context.Background()
	id := createFaultVM(t, vms, "race-1", img.url, img.sum)
	waitVM(t, vms, id, 3*time.Minute, "the VM boots", isReady)
	whole := func(why string) {
		t.Helper()
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		require.NoError(t, err, why)
		v := r.Msg.Vm
		assert.Equal(t, "race-1", v.Name, "%s: not a blank VM", why)
		assert.Equal(t, img.url, v.ImageUrl, why)
		assert.EqualValues(t, 256, v.MemMb, why)
	}
	refusedOrOK := func(what string, err error) bool {
		t.Helper()
		if err == nil {
			return true
		}
		assert.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "%s: %v", what, err)
		return false
	}

	// Delete racing start, a few times over: the delete always takes, a
	// start either came first or is refused.
	_, err := vms.StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: id}))
	require.NoError(t, err)
	for round := range 4 {
		var wg sync.WaitGroup
		var startErr, delErr error
		wg.Add(2)
		go func() {
			defer wg.Done()
			_, startErr = vms.StartVM(ctx, connect.NewRequest(&eitriv1.StartVMRequest{Id: id}))
		}()
		go func() {
			defer wg.Done()
			_, delErr = vms.DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
		}()
		wg.Wait()
		require.NoError(t, delErr, "round %d: the delete", round)
		started := refusedOrOK("start racing delete", startErr)
		t.Logf("round %d: start won=%v", round, started)
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		require.NoError(t, err)
		assert.True(t, r.Msg.Vm.Deleted, "round %d: the VM is deleted whatever came first", round)
		whole("after the race")
		_, err = vms.StartVM(ctx, connect.NewRequest(&eitriv1.StartVMRequest{Id: id}))
		assert.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "a start after the delete is refused: %v", err)
		_, err = vms.RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: id}))
		require.NoError(t, err, "restore within the grace")
		_, err = vms.StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: id}))
		require.NoError(t, err)
	}
	whole("restored")

	// Restore racing destroy: restores fired from just before restores
	// close until just after. Those before win (later ones find it not
	// deleted); none after the close may.
	_, err = vms.StartVM(ctx, connect.NewRequest(&eitriv1.StartVMRequest{Id: id}))
	require.NoError(t, err)
	waitVM(t, vms, id, 2*time.Minute, "running again before the restore race", func(v *eitriv1.VM) bool {
		return isReady(v) && v.ActualPower == "running"
	})
	del, err := vms.DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
	require.NoError(t, err)
	closeAt := del.Msg.Vm.RestorableUntil.AsTime()
	time.Sleep(time.Until(closeAt.Add(-150 * time.Millisecond)))
	var mu sync.Mutex
	var wins, refusals int
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Duration(i) * 40 * time.Millisecond)
			_, err := vms.RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: id}))
			mu.Lock()
			defer mu.Unlock()
			if refusedOrOK("restore racing destroy", err) {
				wins++
			} else {
				refusals++
			}
		}()
	}
	wg.Wait()
	t.Logf("restores at the close: %d won, %d refused", wins, refusals)
	assert.LessOrEqual(t, wins, 1, "a VM is restored once")
	if wins == 1 {
		v := waitVM(t, vms, id, 2*time.Minute, "the restored VM runs", func(v *eitriv1.VM) bool {
			return isReady(v) && v.ActualPower == "running" && !v.Deleted
		})
		assert.Equal(t, "race-1", v.Name)
		time.Sleep(grace) // past the old destroy_at: nothing destroys it
		whole("restored before the close")
		assert.Len(t, qemusOf(t, agentDir, id), 1, "the restored guest runs")
		// And again, now restoring only after the close.
		del, err = vms.DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
		require.NoError(t, err)
		time.Sleep(time.Until(del.Msg.Vm.RestorableUntil.AsTime().Add(100 * time.Millisecond)))
		_, err = vms.RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: id}))
		require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "a restore after the close is refused: %v", err)
	}
	// Refused: the VM is destroyed, never brought back blank.
	deadline := time.Now().Add(time.Minute)
	for {
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		if connect.CodeOf(err) == connect.CodeNotFound {
			break
		}
		require.NoError(t, err)
		v := r.Msg.Vm
		assert.Equal(t, "race-1", v.Name, "never a blank VM")
		assert.True(t, v.Deleted, "a refused restore leaves the VM deleted")
		if v.Lifecycle == "failed" {
			assert.Contains(t, v.LastError, "destroyed at")
		}
		require.True(t, time.Now().Before(deadline), "the VM is not destroyed after its grace: %+v", v)
		time.Sleep(100 * time.Millisecond)
	}
	require.Eventually(t, func() bool { return len(qemusOf(t, agentDir, id)) == 0 }, 30*time.Second, 100*time.Millisecond,
		"the destroyed VM's guest is gone")
}

// An image server that stalls past the pass timeout, serving a download
// slower than it, must not fail the VM for good: the download outlives the
// pass and the VM becomes ready; once failed, the row never says
// "downloading" again.
func TestFaultImageServerStallingPastThePassTimeoutStillFinishes(t *testing.T) {
	if !inNetns(t) {
		return
	}
	faultBin(t)
	dir := faultDir(t)
	// 72 MiB at 4 MiB/s (18 s) with a 25 s stall at 16 MiB: 43 s, against a
	// 20 s pass.
	var stalled sync.Once
	img := newThrottledImage(t, 72<<20, 4<<20, func(off int64) {
		if off >= 16<<20 {
			stalled.Do(func() { time.Sleep(25 * time.Second) })
		}
	})
	dev := startDevBin(t, dir, "--vm-timeout", "20s")
	vms := dev.vmsClient(t, dir)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	watched := watchSightings(ctx, t, vms)
	start := time.Now()
	id := createFaultVM(t, vms, "stall-1", img.url, img.sum)
	var v *eitriv1.VM
	require.Eventually(t, func() bool {
		r, err := vms.GetVM(context.Background(), connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		if err == nil {
			v = r.Msg.Vm
		}
		return err == nil && isReady(v)
	}, 4*time.Minute, 100*time.Millisecond, "the VM becomes ready despite the stall")
	t.Logf("ready after %s; requests (Range headers): %q", time.Since(start).Round(time.Second), img.ranges())
	for _, r := range img.ranges()[1:] {
		assert.True(t, strings.HasPrefix(r, "bytes=") && !strings.HasPrefix(r, "bytes=0-"),
			"the download outlives the pass, never starting over: %q", img.ranges())
	}
	time.Sleep(200 * time.Millisecond)
	failedAt, timedOut := -1, false
	for i, s := range watched.list() {
		t.Logf("seen: %s %q %s", s.lifecycle, s.detail, s.ip)
		if strings.Contains(s.detail, "timed out") {
			timedOut = true
		}
		if s.lifecycle == "failed" && failedAt < 0 {
			failedAt = i
		}
		if failedAt >= 0 {
			assert.False(t, strings.HasPrefix(s.detail, "downloading"), "after a failure the row says %q (%s)", s.detail, s.lifecycle)
		}
	}
	assert.True(t, timedOut, "the stall outlasts a pass (the test proves nothing otherwise)")
}

// vmsClient is devInstance.vms for a subprocess: an admin's VM client, once
// the local host has enrolled.
func (d *devBin) vmsClient(t *testing.T, dir string) eitriv1connect.VMServiceClient {
	return (&devInstance{}).vms(t, dir)
}
