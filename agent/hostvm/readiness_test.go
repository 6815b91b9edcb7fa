package hostvm

import (
	"context"
	"net"
	"net/netip"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/state"
)

// listen serves loopback TCP, answering each connection with greeting
// (nothing at all when empty, holding the connection open).
func listen(t *testing.T, greeting string) uint16 {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			if greeting != "" {
				_, _ = c.Write([]byte(greeting))
			}
			t.Cleanup(func() { c.Close() })
		}
	}()
	return uint16(ln.Addr().(*net.TCPAddr).Port)
}

// Without a phone home, a guest is ready by ssh once SSHFallbackAfter has
// passed and an SSH server greets on its port 22, and by its address alone
// once ReadyWait has; before either, not at all.
func TestJudgeFallsBackToSSHThenToTheAddress(t *testing.T) {
	greets, silent := listen(t, "SSH-2.0-OpenSSH_9.2\r\n"), listen(t, "")
	closed := func() uint16 { // a port nothing listens on
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		p := uint16(ln.Addr().(*net.TCPAddr).Port)
		ln.Close()
		return p
	}()
	lo := netip.MustParseAddr("127.0.0.1")
	started := time.Now()
	tests := []struct {
		name string
		port uint16
		up   time.Duration
		want string
	}{
		{"sshd up early: still waiting for cloud-init", greets, 30 * time.Second, ""},
		{"sshd greets after the fallback wait", greets, 61 * time.Second, SignalSSH},
		{"something silent on 22 is no sshd", silent, 2 * time.Minute, ""},
		{"nothing on 22", closed, 2 * time.Minute, ""},
		{"past the ready wait the address is enough", closed, 11 * time.Minute, SignalDHCP},
		{"but sshd, when it answers, still says more", greets, 11 * time.Minute, SignalSSH},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// A network with no leases: nobody has phoned home.
			h := &Hypervisor{net: &netsetup.Network{}, sshAfter: time.Minute, readyWait: 10 * time.Minute,
				sshPort: tc.port, probed: map[string]time.Time{}}
			assert.Equal(t, tc.want, h.judge(context.Background(), "vm-1", lo, started, started.Add(tc.up), state.ReadinessDefault))
		})
	}

	t.Run("probes are rationed", func(t *testing.T) {
		h := &Hypervisor{net: &netsetup.Network{}, sshAfter: time.Minute, readyWait: 10 * time.Minute,
			sshPort: closed, probed: map[string]time.Time{}}
		now := started.Add(2 * time.Minute)
		assert.Empty(t, h.judge(context.Background(), "vm-1", lo, started, now, state.ReadinessDefault))
		h.sshPort = greets
		assert.Empty(t, h.judge(context.Background(), "vm-1", lo, started, now.Add(time.Second), state.ReadinessDefault), "no second probe within sshProbeEvery")
		assert.Equal(t, SignalSSH, h.judge(context.Background(), "vm-1", lo, started, now.Add(sshProbeEvery), state.ReadinessDefault))
	})
}

// An image's catalogue entry changes the waits: with ssh readiness an
// answering sshd counts from the first moment, with address readiness the
// address alone does, where the default waits minutes for a phone home.
func TestJudgeAsTheImageSays(t *testing.T) {
	greets := listen(t, "SSH-2.0-OpenSSH_9.2\r\n")
	closed := func() uint16 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		p := uint16(ln.Addr().(*net.TCPAddr).Port)
		ln.Close()
		return p
	}()
	lo := netip.MustParseAddr("127.0.0.1")
	started := time.Now()
	for _, tc := range []struct {
		name string
		how  state.Readiness
		port uint16
		want string
	}{
		{"default: sshd up early is not enough", state.ReadinessDefault, greets, ""},
		{"cloud-init: the same", state.ReadinessCloudInit, greets, ""},
		{"ssh: sshd up early is enough", state.ReadinessSSH, greets, SignalSSH},
		{"ssh: but not without sshd", state.ReadinessSSH, closed, ""},
		{"address: the address is enough at once", state.ReadinessAddress, closed, SignalDHCP},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := &Hypervisor{net: &netsetup.Network{}, sshAfter: time.Minute, readyWait: 10 * time.Minute,
				sshPort: tc.port, probed: map[string]time.Time{}}
			assert.Equal(t, tc.want, h.judge(context.Background(), "vm-1", lo, started, started.Add(5*time.Second), tc.how))
		})
	}
}
