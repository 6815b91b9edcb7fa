package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// usageFollowsTheGuest reads the ready guest's samples as a user does,
// through UsageService.WatchUsage, while the test loads it (the dev
// instance in dir samples every second): its CPU rate rises while the guest
// burns CPU, and its tap's bytes cover the datagrams the guest echoed and
// little else.
func usageFollowsTheGuest(t *testing.T, dir string, vm *eitriv1.VM) {
	tok, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	client := eitriv1connect.NewUsageServiceClient(connclient.HTTPClient(""), "http://127.0.0.1:18080",
		connect.WithInterceptors(connclient.Bearer(strings.TrimSpace(string(tok)))))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream, err := client.WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{VmId: vm.Id}))
	require.NoError(t, err)
	defer stream.Close()
	// Only samples pushed after the window: each was measured before the
	// test received it.
	samples := make(chan *eitriv1.VMUsage, 64)
	go func() {
		defer close(samples)
		for stream.Receive() {
			if u := stream.Msg().GetVm(); u != nil {
				select {
				case samples <- u:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	// next is the first sample measured after t0 (At is taken before the
	// counters are read).
	next := func(t0 time.Time) *eitriv1.VMUsage {
		t.Helper()
		timeout := time.After(30 * time.Second)
		for {
			select {
			case u, ok := <-samples:
				require.True(t, ok, "the usage stream ended: %v", stream.Err())
				if u.At.AsTime().After(t0) && u.CpuSeconds != nil && u.Net != nil {
					return u
				}
			case <-timeout:
				require.FailNow(t, "no usage sample measured after "+t0.Format(time.RFC3339Nano))
			}
		}
	}
	cpuRate := func(a, b *eitriv1.VMUsage) float64 {
		return (b.GetCpuSeconds() - a.GetCpuSeconds()) / b.At.AsTime().Sub(a.At.AsTime()).Seconds()
	}

	// CPU: QEMU's CPU seconds per second over a few idle seconds, then over
	// seconds well inside a burn. The guest has one vCPU.
	i0 := next(time.Now())
	i1 := next(i0.At.AsTime().Add(3 * time.Second))
	idle := cpuRate(i0, i1)

	const burnSeconds = 10
	burnStart := time.Now()
	burned := make(chan error, 1)
	go func() {
		hc := &http.Client{Timeout: 2 * burnSeconds * time.Second}
		resp, err := hc.Get(fmt.Sprintf("http://%s/burn?seconds=%d", net.JoinHostPort(vm.AssignedIp, "80"), burnSeconds))
		if err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				err = fmt.Errorf("status %s", resp.Status)
			}
		}
		burned <- err
	}()
	// A second for the request to reach the guest; the window ends well
	// before the burn does.
	b0 := next(burnStart.Add(time.Second))
	b1 := next(b0.At.AsTime().Add(5 * time.Second))
	require.NoError(t, <-burned, "the guest burns CPU on request")
	burnEnd := time.Now()
	require.True(t, b1.At.AsTime().Before(burnEnd), "the burn window %s..%s ends before the guest answers at %s",
		b0.At.AsTime(), b1.At.AsTime(), burnEnd)
	burning := cpuRate(b0, b1)
	t.Logf("cpu: idle %.3f CPU (%.1fs), burning %.3f CPU (%.1fs)", idle,
		i1.At.AsTime().Sub(i0.At.AsTime()).Seconds(), burning, b1.At.AsTime().Sub(b0.At.AsTime()).Seconds())
	// A spinning vCPU keeps its TCG thread busy: about 1 CPU on a quiet
	// host, and still a fair share of one core among a dozen runnable
	// threads on a loaded 2-core host. An idle guest costs about 0.01 CPU
	// (its timer ticks), and contention does not raise that. A sampler that
	// measured nothing, or the wrong process, fails both bounds.
	assert.GreaterOrEqual(t, burning, 0.15, "a burning guest's QEMU uses CPU")
	assert.GreaterOrEqual(t, burning, 5*idle, "burning (%.3f) is well above idle (%.3f)", burning, idle)

	// Network: datagrams echoed one at a time, so every frame each way is
	// known: Ethernet (14) + IPv4 (20) + UDP (8) + payload, unfragmented.
	const datagrams, payload = 300, 1000
	const frame = 14 + 20 + 8 + payload
	n0 := next(time.Now())
	uc, err := net.Dial("udp", net.JoinHostPort(vm.AssignedIp, "7"))
	require.NoError(t, err)
	defer uc.Close()
	msg, buf := bytes.Repeat([]byte{'u'}, payload), make([]byte, 2*payload)
	for i := range datagrams {
		require.NoError(t, uc.SetDeadline(time.Now().Add(5*time.Second)))
		_, err := uc.Write(msg)
		require.NoError(t, err)
		n, err := uc.Read(buf)
		require.NoError(t, err, "the guest echoes datagram %d", i)
		require.Equal(t, payload, n)
	}
	n1 := next(time.Now())
	received := n1.Net.ReceivedBytes - n0.Net.ReceivedBytes
	sent := n1.Net.SentBytes - n0.Net.SentBytes
	want := uint64(datagrams * frame)
	// Beyond the echoes, a few seconds on an otherwise quiet bridge carry
	// at most an ARP exchange, a DHCP renewal and IPv6 neighbour chatter:
	// a few hundred bytes each. 8 KiB is ample, and under 3% of the echoes.
	const slack = 8 << 10
	t.Logf("tap over %.1fs: guest received %d, sent %d; echoes %d each way",
		n1.At.AsTime().Sub(n0.At.AsTime()).Seconds(), received, sent, want)
	assert.GreaterOrEqual(t, received, want, "the guest received every datagram")
	assert.LessOrEqual(t, received, want+slack, "the guest received little besides")
	assert.GreaterOrEqual(t, sent, want, "the guest sent every echo")
	assert.LessOrEqual(t, sent, want+slack, "the guest sent little besides")
	assert.GreaterOrEqual(t, n1.Net.ReceivedPackets-n0.Net.ReceivedPackets, uint64(datagrams))
	assert.GreaterOrEqual(t, n1.Net.SentPackets-n0.Net.SentPackets, uint64(datagrams))
}
