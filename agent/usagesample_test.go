package agent

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/usage"
)

func TestATapsCountersAreTheGuestsTheOtherWayRound(t *testing.T) {
	cpu := 3.5
	n := &usage.Net{RxBytes: 100, TxBytes: 900, RxPackets: 1, TxPackets: 9, RxDropped: 2, TxDropped: 0}
	got := usageSample(usage.Host{At: time.Unix(10, 0), Net: n}, []usage.VM{{ID: "vm-1", At: time.Unix(10, 0), CPUSeconds: &cpu, Net: n}})
	require.Len(t, got.GetVms(), 1)
	vm := got.GetVms()[0]
	assert.Equal(t, uint64(100), vm.GetNet().GetSentBytes(), "what the tap received, the guest sent")
	assert.Equal(t, uint64(900), vm.GetNet().GetReceivedBytes())
	assert.Equal(t, uint64(2), vm.GetNet().GetSentDropped())
	assert.Equal(t, 3.5, vm.GetCpuSeconds())
	assert.Nil(t, vm.Disk, "no disk figures measured, none sent")
	assert.Nil(t, vm.MemoryRssBytes)
	assert.Equal(t, uint64(100), got.GetHost().GetNet().GetReceivedBytes(), "a host's own interface counts from its side")
	assert.Nil(t, got.GetHost().Load, "no load read, none sent")
	assert.Nil(t, got.GetHost().CpuBusySeconds)
}
