package mcp_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	eitrimcp "github.com/a73x/eitri/server/mcp"
)

func TestVMUsageReturnsTheRecentSamplesWithRatesAndNullsForWhatWasNotMeasured(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	vm := adminVM(t, e, "web-1")
	h.report(&eitriv1.ActualVM{VmId: vm.GetId(), Power: "running", Phase: "ready"})
	at := time.Now().Add(-20 * time.Second)
	for i, cpu := range []float64{10, 15, 25} {
		h.sess.Usage(context.Background(), &eitriv1.UsageSample{Vms: []*eitriv1.VMUsage{{
			VmId: vm.GetId(), At: timestamppb.New(at.Add(time.Duration(i) * 10 * time.Second)), CpuSeconds: proto.Float64(cpu),
			MemoryRssBytes: proto.Uint64(300 << 20), Net: &eitriv1.NetUsage{SentBytes: uint64(i) * 10240},
		}}})
	}
	admin := connect(t, e, nil)
	out := ok[eitrimcp.VMUsageOut](t, admin, "vm_usage", map[string]any{"id": vm.GetId()})
	assert.Equal(t, vm.GetId(), out.VMID)
	require.Len(t, out.Samples, 3)
	assert.Nil(t, out.Samples[0].CPUPercent, "no rate before the second sample")
	require.NotNil(t, out.Samples[1].CPUPercent)
	assert.InDelta(t, 50, *out.Samples[1].CPUPercent, 1e-9, "5 CPU seconds in 10 s")
	assert.InDelta(t, 100, *out.Samples[2].CPUPercent, 1e-9)
	require.NotNil(t, out.Samples[2].NetSentBytesPerSecond)
	assert.InDelta(t, 1024, *out.Samples[2].NetSentBytesPerSecond, 1e-9)
	assert.Nil(t, out.Samples[2].DiskReadBytesPerSecond, "disk not measured: null, not 0")
	assert.Equal(t, uint64(300<<20), *out.Samples[2].MemoryRSSBytes)

	bob := connectAs(t, e, e.userToken(t, "bob"), nil)
	assert.Contains(t, refused(t, bob, "vm_usage", map[string]any{"id": vm.GetId()}), "not_found: ")
}
