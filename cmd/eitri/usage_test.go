package main

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

// An agent's samples go over its real Sync stream to the control plane,
// and the CLI reads them back: vm top and host top rank by CPU, vm stats
// lists a VM's window.
func TestUsageFromAnAgentReachesVMTopHostTopAndVMStats(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	id := e.enroll("h1")
	src := &source{}
	cfg := quickAgent(id, src, "")
	cfg.UsageEvery = 20 * time.Millisecond
	start := time.Now()
	var busy, idle atomic.Pointer[string]
	empty := ""
	busy.Store(&empty)
	idle.Store(&empty)
	// The busy VM burns half a CPU, the idle one a hundredth; the host is
	// a quarter busy over 2 CPUs.
	cfg.Usage = func(context.Context) *eitriv1.UsageSample {
		now := time.Now()
		el := now.Sub(start).Seconds()
		vm := func(id string, share float64) *eitriv1.VMUsage {
			return &eitriv1.VMUsage{VmId: id, At: timestamppb.New(now), CpuSeconds: proto.Float64(el * share),
				MemoryRssBytes: proto.Uint64(300 << 20), Net: &eitriv1.NetUsage{ReceivedBytes: uint64(el * 1024), SentBytes: uint64(el * 2048)}}
		}
		u := &eitriv1.UsageSample{Host: &eitriv1.HostUsage{At: timestamppb.New(now), Cpus: 2, CpuBusySeconds: proto.Float64(el * 0.5),
			MemoryTotalBytes: proto.Uint64(8 << 30), MemoryAvailableBytes: proto.Uint64(6 << 30), Load: &eitriv1.LoadAverage{Load1: 0.42}}}
		if id := *busy.Load(); id != "" {
			u.Vms = append(u.Vms, vm(id, 0.5), vm(*idle.Load(), 0.01))
		}
		return u
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := startAgentStream(ctx, cfg)
	t.Cleanup(func() { cancel(); <-done })

	require.Eventually(t, func() bool {
		h, err := e.srv.Fleet.ListHosts(e.adminCtx())
		return err == nil && len(h) == 1 && h[0].GetCapacity() != nil
	}, 10*time.Second, 10*time.Millisecond, "the host reports its capacity")
	for _, name := range []string{"busy", "idle"} {
		_, err := e.eitri("vm", "create", name, "--image", "http://images.test/guest.raw", "--sha256", strings.Repeat("ab", 32))
		require.NoError(t, err)
	}
	vms, err := e.srv.Fleet.ListVMs(e.adminCtx())
	require.NoError(t, err)
	require.Len(t, vms, 2)
	ids := map[string]string{}
	for _, v := range vms {
		ids[v.GetName()] = v.GetId()
	}
	src.mu.Lock()
	src.vms = []*eitriv1.ActualVM{{VmId: ids["busy"], Power: "running", Phase: "ready"}, {VmId: ids["idle"], Power: "running", Phase: "ready"}}
	src.mu.Unlock()
	b, i := ids["busy"], ids["idle"]
	busy.Store(&b)
	idle.Store(&i)

	var out string
	require.Eventually(t, func() bool {
		out, err = e.eitri("vm", "top", "--once")
		return err == nil && rowHas(out, "busy", "%") && rowHas(out, "idle", "%")
	}, 15*time.Second, 50*time.Millisecond, "vm top never showed both VMs' CPU:\n%s", out)
	assert.Less(t, lineOf(out, "busy"), lineOf(out, "idle"), "the busiest first:\n%s", out)
	assert.Contains(t, out, "300.0 MiB")

	require.Eventually(t, func() bool {
		out, err = e.eitri("host", "top", "--once")
		return err == nil && rowHas(out, "h1", "%")
	}, 15*time.Second, 50*time.Millisecond, "host top never showed the host's CPU:\n%s", out)
	assert.Contains(t, out, "2.0 GiB of 8.0 GiB")
	assert.Contains(t, out, "0.42")

	out, err = e.eitri("vm", "stats", "busy", "--no-follow")
	require.NoError(t, err)
	assert.Contains(t, out, "TIME")
	assert.Contains(t, out, "%")
}

// rowHas says whether the line holding key also holds want.
func rowHas(out, key, want string) bool {
	n := lineOf(out, key)
	if n < 0 {
		return false
	}
	return strings.Contains(strings.Split(out, "\n")[n], want)
}

// lineOf is the index of the first line of out holding key, or -1.
func lineOf(out, key string) int {
	for i, l := range strings.Split(out, "\n") {
		if strings.Contains(l, key) {
			return i
		}
	}
	return -1
}
