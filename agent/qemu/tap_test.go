package qemu

import (
	"context"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/netnstest"
)

func TestStartWithTap(t *testing.T) {
	hosttest.NeedQEMU(t)
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

// inNetns runs body in its own network namespace.
func inNetns(t *testing.T, body func(t *testing.T)) {
	netnstest.Run(t, 80*time.Second, "creates a network namespace with a tap for QEMU", body)
}
