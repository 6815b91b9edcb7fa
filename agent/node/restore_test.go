package node

import (
	"bufio"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/exposeproxy"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// echoGuest is a loopback "guest" that echoes what it is sent.
func echoGuest(t *testing.T, ip string) uint32 {
	t.Helper()
	l, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	require.NoError(t, err)
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	return uint32(l.Addr().(*net.TCPAddr).Port)
}

// agentRun is one run of the agent's node over a state directory: its own
// engine stand-in and its own proxy, as after a process start.
type agentRun struct {
	n     *Node
	eng   *engine
	proxy *exposeproxy.Proxy
}

func startAgent(t *testing.T, dir string, guestAddr func(string) (netip.Addr, bool)) *agentRun {
	t.Helper()
	st, err := state.Open(dir)
	require.NoError(t, err)
	r := &agentRun{eng: &engine{changed: make(chan struct{}, 1)}}
	r.proxy = exposeproxy.New(exposeproxy.Config{Resolve: func(id string) (netip.Addr, bool) { return r.n.Resolve(id) }})
	t.Cleanup(func() { r.proxy.Close() })
	r.n = New(Config{Engine: r.eng, Ports: r.proxy, Records: st, GuestAddr: guestAddr})
	return r
}

func echoes(hostPort uint32) error {
	c, err := net.DialTimeout("tcp", net.JoinHostPort("127.0.0.1", itoa(hostPort)), time.Second)
	if err != nil {
		return err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := c.Write([]byte("ping\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return err
	}
	if line != "ping\n" {
		return io.ErrUnexpectedEOF
	}
	return nil
}

func exposure(id, vm string, hostPort, guestPort uint32) *eitriv1.ExposureDesired {
	return &eitriv1.ExposureDesired{Id: id, VmId: vm, Protocol: "tcp", Scope: "local", HostPort: hostPort, GuestPort: guestPort, MaxSessions: 16}
}

func TestARestartedAgentServesItsPublishedPortsBeforeTheControlPlaneAnswers(t *testing.T) {
	dir := t.TempDir()
	guestPort := echoGuest(t, "127.0.0.2")
	hostPort := uint32(hosttest.FreePort(t, "tcp"))
	leased := func(id string) (netip.Addr, bool) {
		if id == "vm1" {
			return netip.MustParseAddr("127.0.0.2"), true
		}
		return netip.Addr{}, false
	}

	first := startAgent(t, dir, leased)
	first.eng.vms = []*eitriv1.ActualVM{{VmId: "vm1", Power: "running", Phase: "ready", Ip: "127.0.0.2"}}
	require.True(t, first.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 1, Exposures: []*eitriv1.ExposureDesired{exposure("x1", "vm1", hostPort, guestPort)}}))
	require.NoError(t, echoes(hostPort))

	// The agent dies while the control plane is down; the guest keeps
	// running. The port goes with the process.
	first.proxy.Close()
	require.Error(t, echoes(hostPort))

	// A new agent process: no snapshot comes, the engine reports nothing yet.
	second := startAgent(t, dir, leased)
	require.NoError(t, second.n.Restore())
	require.NoError(t, echoes(hostPort), "the published port is back without the control plane")

	rep := report(second.n)
	require.Len(t, rep.Exposures, 1)
	assert.Equal(t, "x1", rep.Exposures[0].GetId())
	assert.Equal(t, "active", rep.Exposures[0].GetState())
	assert.Zero(t, rep.Exposures[0].GetSessions().GetDropped(), "the restored port reached its guest")
}

func TestEveryAppliedSnapshotReplacesTheKeptPorts(t *testing.T) {
	dir := t.TempDir()
	guestPort := echoGuest(t, "127.0.0.2")
	p1, p2 := uint32(hosttest.FreePort(t, "tcp")), uint32(hosttest.FreePort(t, "tcp"))
	leased := func(string) (netip.Addr, bool) { return netip.MustParseAddr("127.0.0.2"), true }

	first := startAgent(t, dir, leased)
	require.True(t, first.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 1, Exposures: []*eitriv1.ExposureDesired{exposure("x1", "vm1", p1, guestPort)}}))
	require.True(t, first.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 2, Exposures: []*eitriv1.ExposureDesired{exposure("x2", "vm1", p2, guestPort)}}))
	first.proxy.Close()

	second := startAgent(t, dir, leased)
	require.NoError(t, second.n.Restore())
	assert.NoError(t, echoes(p2))
	assert.Error(t, echoes(p1), "a port the last snapshot dropped stays closed after a restart")

	// Unpublishing everything is kept too: nothing comes back.
	require.True(t, second.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 3}))
	second.proxy.Close()
	third := startAgent(t, dir, leased)
	require.NoError(t, third.n.Restore())
	assert.Empty(t, report(third.n).Exposures)
	assert.Error(t, echoes(p2))
}

func TestASnapshotTheEngineRefusesDoesNotReplaceTheKeptPorts(t *testing.T) {
	dir := t.TempDir()
	guestPort := echoGuest(t, "127.0.0.2")
	p1, p2 := uint32(hosttest.FreePort(t, "tcp")), uint32(hosttest.FreePort(t, "tcp"))
	leased := func(string) (netip.Addr, bool) { return netip.MustParseAddr("127.0.0.2"), true }

	first := startAgent(t, dir, leased)
	require.True(t, first.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 5, Exposures: []*eitriv1.ExposureDesired{exposure("x1", "vm1", p1, guestPort)}}))
	first.eng.refuse = true // a stale generation
	require.False(t, first.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 4, Exposures: []*eitriv1.ExposureDesired{exposure("x2", "vm1", p2, guestPort)}}))
	first.proxy.Close()

	second := startAgent(t, dir, leased)
	require.NoError(t, second.n.Restore())
	assert.NoError(t, echoes(p1))
	assert.Error(t, echoes(p2))
}

func TestASnapshotAppliedBeforeRestoreWins(t *testing.T) {
	dir := t.TempDir()
	guestPort := echoGuest(t, "127.0.0.2")
	old, cur := uint32(hosttest.FreePort(t, "tcp")), uint32(hosttest.FreePort(t, "tcp"))
	leased := func(string) (netip.Addr, bool) { return netip.MustParseAddr("127.0.0.2"), true }

	first := startAgent(t, dir, leased)
	require.True(t, first.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 1, Exposures: []*eitriv1.ExposureDesired{exposure("x-old", "vm1", old, guestPort)}}))
	first.proxy.Close()

	second := startAgent(t, dir, leased)
	require.True(t, second.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 2, Exposures: []*eitriv1.ExposureDesired{exposure("x-cur", "vm1", cur, guestPort)}}))
	require.NoError(t, second.n.Restore())
	assert.NoError(t, echoes(cur))
	assert.Error(t, echoes(old), "the saved ports are older than the snapshot")
}

func TestAGuestTheEngineReportsStoppedIsNotDialedOnTheHostsWord(t *testing.T) {
	dir := t.TempDir()
	guestPort := echoGuest(t, "127.0.0.2")
	hostPort := uint32(hosttest.FreePort(t, "tcp"))
	leased := func(string) (netip.Addr, bool) { return netip.MustParseAddr("127.0.0.2"), true }

	r := startAgent(t, dir, leased)
	require.True(t, r.n.Apply(&eitriv1.DesiredStateSnapshot{Generation: 1, Exposures: []*eitriv1.ExposureDesired{exposure("x1", "vm1", hostPort, guestPort)}}))
	require.NoError(t, echoes(hostPort), "no row yet: the host's lease answers")

	r.eng.vms = []*eitriv1.ActualVM{{VmId: "vm1", Power: "stopped", Phase: "stopped", Ip: "127.0.0.2"}}
	r.n.refreshAddrs() // what Run does on the engine's Changed
	_, ok := r.n.Resolve("vm1")
	assert.False(t, ok, "the engine's word wins once it has one")
}

func TestADamagedPortsRecordIsReportedNotTakenAsNoPorts(t *testing.T) {
	dir := t.TempDir()
	st, err := state.Open(dir)
	require.NoError(t, err)
	require.NoError(t, st.SaveExposures([]state.Exposure{{ID: "x1", VMID: "vm1", Protocol: "tcp", Scope: "local", HostPort: 1, GuestPort: 1}}))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "exposures.json"), []byte(`{"Exposures":[{"ID":`), 0o600))

	r := startAgent(t, dir, nil)
	require.Error(t, r.n.Restore())
	assert.Empty(t, report(r.n).Exposures)
}
