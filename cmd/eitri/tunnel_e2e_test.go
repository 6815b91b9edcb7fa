package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
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
