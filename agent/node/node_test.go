package node

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/exposeproxy"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// engine stands in for the reconcile engine: it reports the rows a test sets.
type engine struct {
	vms     []*eitriv1.ActualVM
	changed chan struct{}
	refuse  bool // Apply refuses every snapshot (a stale generation)
}

func (e *engine) Apply(*eitriv1.DesiredStateSnapshot) bool { return !e.refuse }
func (e *engine) Fill(rep *eitriv1.ActualStateReport)      { rep.Vms = e.vms }
func (e *engine) Changed() <-chan struct{}                 { return e.changed }

func TestAPublishedPortCarriesTrafficAndItsCountersReachTheReport(t *testing.T) {
	// The "guest" is a loopback echo server.
	guest, err := net.Listen("tcp", "127.0.0.2:0")
	require.NoError(t, err)
	defer guest.Close()
	go func() {
		for {
			c, err := guest.Accept()
			if err != nil {
				return
			}
			go func() { _, _ = io.Copy(c, c); c.Close() }()
		}
	}()
	eng := &engine{changed: make(chan struct{}, 1)}
	var n *Node
	proxy := exposeproxy.New(exposeproxy.Config{Resolve: func(id string) (netip.Addr, bool) { return n.Resolve(id) }})
	defer proxy.Close()
	n = New(Config{Engine: eng, Ports: proxy, Capacity: func() *eitriv1.Capacity { return &eitriv1.Capacity{Vcpus: 2} }})

	hostPort := uint32(hosttest.FreePort(t, "tcp"))
	snap := &eitriv1.DesiredStateSnapshot{Generation: 1, Exposures: []*eitriv1.ExposureDesired{{
		Id: "x1", VmId: "vm1", Protocol: "tcp", Scope: "local", HostPort: hostPort,
		GuestPort: uint32(guest.Addr().(*net.TCPAddr).Port),
	}}}

	// Before the guest has an address a caller is dropped, and counted.
	require.True(t, n.Apply(snap))
	c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", itoa(hostPort)))
	require.NoError(t, err)
	_, _ = c.Read(make([]byte, 1))
	c.Close()
	require.Eventually(t, func() bool { return report(n).Exposures[0].GetSessions().GetDropped() == 1 }, 5*time.Second, 10*time.Millisecond)

	// The guest leases an address: traffic flows.
	eng.vms = []*eitriv1.ActualVM{{VmId: "vm1", Power: "running", Phase: "ready", Ip: "127.0.0.2"}}
	require.True(t, n.Apply(snap))
	c, err = net.Dial("tcp", net.JoinHostPort("127.0.0.1", itoa(hostPort)))
	require.NoError(t, err)
	defer c.Close()
	_, err = c.Write([]byte("hello\n"))
	require.NoError(t, err)
	line, err := bufio.NewReader(c).ReadString('\n')
	require.NoError(t, err)
	assert.Equal(t, "hello\n", line)

	// The dropped caller's session may end just after it was counted as
	// dropped, so wait for the gauge to settle on this one open session.
	require.Eventually(t, func() bool { return report(n).Exposures[0].GetSessions().GetActive() == 1 }, 5*time.Second, 10*time.Millisecond)
	// The echo's bytes each way; the way back is counted once its splice
	// returns, which may be just after the caller read it.
	require.Eventually(t, func() bool {
		c := report(n).Exposures[0].GetSessions().GetCarried()
		return c != nil && c.GetIn() == 6 && c.GetOut() == 6
	}, 5*time.Second, 10*time.Millisecond, "bytes in/out: %v", report(n).Exposures[0].GetSessions())
	rep := report(n)
	require.Len(t, rep.Exposures, 1)
	assert.Equal(t, "active", rep.Exposures[0].State)
	require.NotNil(t, rep.Exposures[0].Sessions, "this agent counts, so it always says so")
	assert.Equal(t, int64(1), rep.Exposures[0].Sessions.Active)
	assert.Equal(t, int32(2), rep.Capacity.GetVcpus())
	assert.Nil(t, rep.Metrics, "no metrics source: nothing reported, not zeros")
}

func TestLanScopeListensEverywhereLocalOnLoopback(t *testing.T) {
	lan := Spec(&eitriv1.ExposureDesired{Scope: "lan", HostPort: 30080, Protocol: "udp"})
	assert.True(t, lan.Listen.Addr().IsUnspecified())
	assert.Equal(t, exposeproxy.UDP, lan.Protocol)
	local := Spec(&eitriv1.ExposureDesired{Scope: "local", HostPort: 30080})
	assert.True(t, local.Listen.Addr().IsLoopback())
}

func report(n *Node) *eitriv1.ActualStateReport {
	rep := &eitriv1.ActualStateReport{}
	n.Fill(rep)
	return rep
}

func itoa(p uint32) string { return strconv.Itoa(int(p)) }

func TestTheReportCarriesTheAcceleratorAsItIsNow(t *testing.T) {
	eng := &engine{changed: make(chan struct{}, 1)}
	proxy := exposeproxy.New(exposeproxy.Config{Resolve: func(string) (netip.Addr, bool) { return netip.Addr{}, false }})
	defer proxy.Close()
	name, why := "kvm", "kvm works with -cpu host"
	n := New(Config{Engine: eng, Ports: proxy, Accelerator: func() (string, string) { return name, why }})
	rep := report(n)
	assert.Equal(t, "kvm", rep.Accelerator)
	assert.Equal(t, "kvm works with -cpu host", rep.AcceleratorReason)

	// A re-probe moved the host to tcg: the next report says so.
	name, why = "tcg", "kvm unusable: KVM internal error; running under tcg"
	rep = report(n)
	assert.Equal(t, "tcg", rep.Accelerator)
	assert.Equal(t, why, rep.AcceleratorReason)

	silent := New(Config{Engine: eng, Ports: proxy})
	assert.Empty(t, report(silent).Accelerator, "no source: said only in hello")
}

// countingEngine counts how often the report is built.
type countingEngine struct {
	mu      sync.Mutex
	vms     []*eitriv1.ActualVM
	fills   int
	changed chan struct{}
}

func (e *countingEngine) Apply(*eitriv1.DesiredStateSnapshot) bool { return true }
func (e *countingEngine) Changed() <-chan struct{}                 { return e.changed }
func (e *countingEngine) Fill(rep *eitriv1.ActualStateReport) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.fills++
	rep.Vms = e.vms
}

func (e *countingEngine) set(detail string) {
	e.mu.Lock()
	e.vms = []*eitriv1.ActualVM{{VmId: "vm1", Power: "running", Phase: "creating", StatusDetail: detail}}
	e.mu.Unlock()
	e.changed <- struct{}{}
}

func TestAChangeIsBuiltOnceHoweverOftenTheReportIsAskedFor(t *testing.T) {
	eng := &countingEngine{changed: make(chan struct{}, 1)}
	proxy := exposeproxy.New(exposeproxy.Config{Resolve: func(string) (netip.Addr, bool) { return netip.Addr{}, false }})
	defer proxy.Close()
	n := New(Config{Engine: eng, Ports: proxy})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go n.Run(ctx)

	for i, detail := range []string{"downloading image 1%", "downloading image 2%", "booting"} {
		eng.set(detail)
		<-n.Changed() // forwarded once the node has read the change
		for range 5 {
			assert.Equal(t, detail, report(n).GetVms()[0].GetStatusDetail(), "the report says the newest word")
		}
		eng.mu.Lock()
		fills := eng.fills
		eng.mu.Unlock()
		assert.Equal(t, i+1, fills, "one build per change: the node's own (for addresses), sent as it is")
	}
}
