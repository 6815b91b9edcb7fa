package main

import (
	"context"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// Tunnels to the project's test guest, booted by a real agent: its HTTP
// server on port 80 through `eitri port-forward` and `eitri tunnel`, and
// `eitri ssh` reaching the guest's port 22 (the test guest has no sshd,
// only a greeter that sends an SSH banner, which ssh reports).
func TestTunnelsReachTheTestGuest(t *testing.T) {
	if !inNetns(t) {
		return
	}
	dir := t.TempDir()
	imgURL, imgSum := serveFile(t, os.Getenv("EITRI_GUEST_IMAGE"))
	// Usage every second: the usage subtest reads several samples in seconds.
	dev := startDevWith(t, dir, "--usage-every", "1s")
	defer func() { dev.stop(t) }()
	vms := dev.vms(t, dir)
	ctx := context.Background()
	tokenBytes, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	t.Setenv("EITRI_URL", "http://127.0.0.1:18080")
	t.Setenv("EITRI_TOKEN", strings.TrimSpace(string(tokenBytes)))
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())

	created, err := vms.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{
		Name: "tun-1", ImageUrl: imgURL, ImageSha256: imgSum, Vcpus: 1, MemMb: 256, DiskGb: 1}))
	require.NoError(t, err)
	id := created.Msg.Vm.Id
	var vm *eitriv1.VM
	require.Eventually(t, func() bool {
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		if err != nil {
			return false
		}
		vm = r.Msg.Vm
		return vm.Lifecycle == "ready"
	}, 4*time.Minute, 500*time.Millisecond, "the guest is ready")

	t.Run("eitri port-forward", func(t *testing.T) {
		local := hosttest.FreePort(t, "tcp")
		fctx, stop := context.WithCancel(ctx)
		var errOut outputtest.Buffer
		done := make(chan error, 1)
		go func() {
			done <- execute(fctx, []string{"port-forward", "tun-1", fmt.Sprintf("%d:80", local)}, cli.IO{In: strings.NewReader(""), Out: io.Discard, Err: &errOut})
		}()
		var body string
		require.Eventually(t, func() bool {
			began := time.Now()
			resp, err := http.Get("http://127.0.0.1:" + strconv.Itoa(local) + "/")
			t.Logf("GET through the forward: %v after %s", err, time.Since(began))
			if err != nil {
				return false
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			body = string(b)
			return resp.StatusCode == http.StatusOK
		}, time.Minute, 200*time.Millisecond, "the guest's HTTP server answers through the forward: %s", errOut.String())
		assert.Contains(t, body, "hostname=tun-1", "the guest's own page")
		stop()
		require.NoError(t, <-done)
	})

	t.Run("eitri tunnel", func(t *testing.T) {
		var out, errOut outputtest.Buffer
		err := execute(ctx, []string{"tunnel", "tun-1", "80"}, cli.IO{In: strings.NewReader("GET / HTTP/1.0\r\n\r\n"), Out: &out, Err: &errOut})
		require.NoError(t, err, errOut.String())
		assert.Contains(t, out.String(), "200 OK")
		assert.Contains(t, out.String(), "hostname=tun-1")
	})

	t.Run("a port nothing listens on is refused by the guest", func(t *testing.T) {
		var out, errOut outputtest.Buffer
		err := execute(ctx, []string{"tunnel", "tun-1", "81"}, cli.IO{In: strings.NewReader(""), Out: &out, Err: &errOut})
		require.Error(t, err)
		assert.Contains(t, err.Error(), "failed precondition")
		assert.Contains(t, err.Error(), "port 81")
	})

	t.Run("eitri ssh reaches the guest's port 22 through the tunnel", func(t *testing.T) {
		bin := os.Getenv("EITRI_BIN")
		if bin == "" {
			t.Skip("EITRI_BIN is not set: ssh runs `eitri tunnel` as its ProxyCommand")
		}
		if _, err := os.Stat("/usr/bin/ssh"); err != nil {
			t.Skip("no ssh client")
		}
		abs, err := filepath.Abs(bin)
		require.NoError(t, err)
		var out, errOut outputtest.Buffer
		err = execute(ctx, []string{"ssh", "tun-1", "--", "-v", "-o", "BatchMode=yes", "-o", "ConnectTimeout=60", "true"},
			cli.IO{In: strings.NewReader(""), Out: &out, Err: &errOut, Self: func() (string, error) { return abs, nil }})
		require.Error(t, err, "the greeter is no sshd: ssh fails after the banner")
		assert.Contains(t, errOut.String(), "remote software version eitri-guest", "ssh read the guest's banner through the tunnel")
		known, err := os.ReadFile(filepath.Join(os.Getenv("XDG_CONFIG_HOME"), "eitri", "known_hosts"))
		require.NoError(t, err)
		assert.True(t, strings.HasPrefix(string(known), "eitri-"+id+" "), "the guest's host key is pinned: %s", known)
	})

	t.Run("a real Prometheus sees the guest's CPU and its published ports' bytes", func(t *testing.T) {
		prometheusSeesTheGuest(t, dir, id)
	})

	t.Run("usage samples follow the guest's CPU and its tap's bytes", func(t *testing.T) { usageFollowsTheGuest(t, dir, vm) })

	t.Run("eitri vm stats prints the guest's measured usage", func(t *testing.T) { vmStatsShowsTheGuest(t, dir, vm) })

	r, err := vms.ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: id}))
	require.NoError(t, err)
	var tunnels []string
	for _, ev := range r.Msg.Events {
		if ev.Kind == "tunnel" {
			tunnels = append(tunnels, ev.Message)
		}
	}
	assert.NotEmpty(t, tunnels, "each tunnel is in the VM's events")
	t.Logf("tunnel events: %q", tunnels)
}

// vmStatsShowsTheGuest runs `eitri vm stats --no-follow` on the ready
// guest after making it burn CPU for a few seconds: the table has a line per
// sample with a CPU figure that saw the burn, the QEMU process's memory and
// the tap's rates; -o json names the VM and its host.
func vmStatsShowsTheGuest(t *testing.T, dir string, vm *eitriv1.VM) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tok, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	usage := eitriv1connect.NewUsageServiceClient(connclient.HTTPClient(""), "http://127.0.0.1:18080",
		connect.WithInterceptors(connclient.Bearer(strings.TrimSpace(string(tok)))))
	stream, err := usage.WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{VmId: vm.Id}))
	require.NoError(t, err)
	defer stream.Close()

	const burnSeconds = 5
	burnStart := time.Now()
	hc := &http.Client{Timeout: 3 * burnSeconds * time.Second}
	resp, err := hc.Get(fmt.Sprintf("http://%s/burn?seconds=%d", net.JoinHostPort(vm.AssignedIp, "80"), burnSeconds))
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	burnEnd := time.Now()
	// The control plane holds every sample it has pushed: once one measured
	// after the burn arrives, the window covers the whole burn.
	for {
		require.True(t, stream.Receive(), "the usage stream ended: %v", stream.Err())
		if u := stream.Msg().GetVm(); u != nil && u.GetAt().AsTime().After(burnEnd) {
			break
		}
	}

	var out, errOut outputtest.Buffer
	require.NoError(t, execute(ctx, []string{"vm", "stats", vm.Name, "--no-follow"}, cli.IO{In: strings.NewReader(""), Out: &out, Err: &errOut}),
		errOut.String())
	t.Logf("eitri vm stats %s --no-follow:\n%s", vm.Name, out.String())
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	columns := regexp.MustCompile(`\s{2,}`)
	require.Equal(t, []string{"TIME", "CPU", "MEMORY", "DISK R/W", "NET IN/OUT"}, columns.Split(lines[0], -1))
	// The guest has been up for minutes, sampled every second.
	require.Greater(t, len(lines), 1+10)
	cpuFigure := regexp.MustCompile(`^(\d+\.\d)%$`)
	perSecond := regexp.MustCompile(`^(\d+(?:\.\d)?) (B|KiB|MiB|GiB|TiB)/s / (\d+(?:\.\d)?) (B|KiB|MiB|GiB|TiB)/s$`)
	var netIn float64
	var rated, inBurn int
	for _, l := range lines[1:] {
		f := columns.Split(strings.TrimSpace(l), -1)
		require.Len(t, f, 5, "line %q", l)
		clock, err := time.ParseInLocation(time.TimeOnly, f[0], time.Local)
		require.NoError(t, err, "line %q", l)
		y, mo, d := burnStart.Date()
		at := time.Date(y, mo, d, clock.Hour(), clock.Minute(), clock.Second(), 0, time.Local)
		mem, err := parseBytes(f[2])
		require.NoError(t, err, "line %q", l)
		assert.Greater(t, mem, float64(8<<20), "QEMU's resident memory, line %q", l)
		m := cpuFigure.FindStringSubmatch(f[1])
		if m == nil {
			// Only a line without a previous sample of the same QEMU has
			// no rates.
			assert.Equal(t, []string{"—", "—", "—"}, []string{f[1], f[3], f[4]}, "line %q", l)
			continue
		}
		rated++
		cpu, _ := strconv.ParseFloat(m[1], 64)
		// A line's rate runs from the sample before it (about a second
		// earlier; the clock is truncated to the second) to its own.
		if at.Add(-time.Second).After(burnStart) && at.Add(time.Second).Before(burnEnd) {
			inBurn++
			// The same floor as the usage subtest's: a burning vCPU gets
			// a fair share of a core even on a loaded host; idle is ~3%.
			assert.GreaterOrEqual(t, cpu, 15.0, "a line inside the burn, %q", l)
		}
		require.Regexp(t, perSecond, f[3], "disk read/write rates, line %q", l)
		n := perSecond.FindStringSubmatch(f[4])
		require.NotNil(t, n, "the tap's rates, line %q", l)
		in, err := parseBytes(n[1] + " " + n[2])
		require.NoError(t, err)
		netIn += in
	}
	assert.GreaterOrEqual(t, rated, len(lines)-2, "every sample but the first has rates")
	assert.Positive(t, inBurn, "some lines fall inside the %ds burn", burnSeconds)
	assert.Positive(t, netIn, "the tap carried the guest's traffic (the burn request at least)")

	// The machine form names the VM and its host in every sample.
	var js outputtest.Buffer
	require.NoError(t, execute(ctx, []string{"vm", "stats", vm.Id, "--no-follow", "-o", "json"}, cli.IO{In: strings.NewReader(""), Out: &js, Err: &errOut}),
		errOut.String())
	var win eitriv1.WatchUsageResponse
	require.NoError(t, protojson.Unmarshal([]byte(strings.TrimSpace(js.String())), &win), js.String())
	require.NotEmpty(t, win.GetWindow().GetVms())
	for _, u := range win.GetWindow().GetVms() {
		assert.Equal(t, vm.Id, u.GetVmId())
		assert.Equal(t, vm.HostId, u.GetHostId())
	}
}

// parseBytes reads the CLI's human byte counts ("812 B", "1.5 MiB").
func parseBytes(s string) (float64, error) {
	num, unit, ok := strings.Cut(s, " ")
	if !ok {
		return 0, fmt.Errorf("no unit in %q", s)
	}
	v, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, err
	}
	i := slices.Index([]string{"B", "KiB", "MiB", "GiB", "TiB"}, unit)
	if i < 0 {
		return 0, fmt.Errorf("unknown unit in %q", s)
	}
	return v * math.Pow(1024, float64(i)), nil
}
