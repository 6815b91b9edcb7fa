package qemu

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// innerEnv names the test a re-executed test binary runs for real, inside
// the network namespace its parent created.
const innerEnv = "EITRI_QEMU_IN_NETNS"

// inNetns re-executes this test under `ip netns exec` in a fresh namespace,
// so the tap and the QEMU attached to it never touch the host's network.
func inNetns(t *testing.T, body func(t *testing.T)) {
	t.Helper()
	if os.Getenv(innerEnv) == t.Name() {
		body(t)
		return
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: creates a network namespace and a tap")
	}
	ip, err := exec.LookPath("ip")
	if err != nil {
		t.Skip("needs iproute2's ip (apt-get install iproute2)")
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	ns := "eitri-test-" + hex.EncodeToString(suffix)
	out, err := exec.Command(ip, "netns", "add", ns).CombinedOutput()
	require.NoError(t, err, "ip netns add: %s", out)
	t.Cleanup(func() {
		out, err := exec.Command(ip, "netns", "del", ns).CombinedOutput()
		assert.NoError(t, err, "ip netns del: %s", out)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, ip, "netns", "exec", ns, os.Args[0],
		"-test.run=^"+regexp.QuoteMeta(t.Name())+"$", "-test.count=1", "-test.v", "-test.timeout=80s")
	cmd.Env = append(os.Environ(), innerEnv+"="+t.Name())
	out, err = cmd.CombinedOutput()
	t.Logf("inside %s:\n%s", ns, out)
	require.NoError(t, err)
	require.Contains(t, string(out), "--- PASS: "+t.Name(), "the test body did not run inside the namespace")
}

func TestStartWithTap(t *testing.T) {
	needQEMU(t)
	inNetns(t, func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		const tap = "tap-q"
		for _, args := range [][]string{{"tuntap", "add", "dev", tap, "mode", "tap"}, {"link", "set", tap, "up"}} {
			out, err := exec.Command("ip", args...).CombinedOutput()
			require.NoError(t, err, "ip %v: %s", args, out)
		}
		carrier := func() string {
			b, _ := os.ReadFile("/sys/class/net/" + tap + "/carrier")
			return strings.TrimSpace(string(b))
		}
		require.Equal(t, "0", carrier(), "nothing is attached to the tap yet")

		b := newBackend(t, 300*time.Millisecond)
		vm := blankVM(t, b, "vm-net")
		vm.Tap = tap
		vm.MAC = net.HardwareAddr{0x02, 0x00, 0x00, 0x00, 0x00, 0x01}
		t.Cleanup(func() { _ = b.Destroy(context.Background(), vm.ID) })

		require.NoError(t, b.Start(ctx, vm))
		running, err := b.Running(ctx, vm.ID)
		require.NoError(t, err)
		assert.True(t, running)
		assert.Equal(t, "1", carrier(), "QEMU must have opened the tap")

		require.NoError(t, b.Destroy(ctx, vm.ID))
		assert.Eventually(t, func() bool { return carrier() == "0" }, 5*time.Second, 50*time.Millisecond,
			"the tap is released when QEMU is gone")
	})
}
