package usage

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func vmSample(id, host string, cpu float64) *eitriv1.VMUsage {
	return &eitriv1.VMUsage{VmId: id, HostId: host, At: timestamppb.New(time.Unix(int64(cpu), 0)), CpuSeconds: proto.Float64(cpu)}
}

func TestAWindowKeepsOnlyTheNewestPointsOldestFirst(t *testing.T) {
	st := New(5, 0)
	for i := range 12 {
		st.AddVM("alice", vmSample("vm-1", "h1", float64(i)))
		st.AddHost(&eitriv1.HostUsage{HostId: "h1", Cpus: int32(i)})
	}
	w, win := st.Watch(Scope{})
	defer w.Close()
	require.Len(t, win.Vms, 5, "the window is bounded")
	for i, u := range win.Vms {
		assert.Equal(t, float64(7+i), u.GetCpuSeconds())
	}
	require.Len(t, win.Hosts, 5)
	assert.Equal(t, int32(7), win.Hosts[0].GetCpus())
	assert.Equal(t, int32(11), win.Hosts[4].GetCpus())
}

func TestAWatcherHearsOnlyWhatItsScopeAllows(t *testing.T) {
	st := New(0, 0)
	st.AddVM("alice", vmSample("a-1", "h1", 1))
	st.AddVM("bob", vmSample("b-1", "h1", 2))
	st.AddHost(&eitriv1.HostUsage{HostId: "h1"})

	alice, win := st.Watch(Scope{Owner: "alice"})
	defer alice.Close()
	require.Len(t, win.Vms, 1)
	assert.Equal(t, "a-1", win.Vms[0].GetVmId())
	assert.Len(t, win.Hosts, 1, "every user sees the hosts")

	one, win := st.Watch(Scope{VMID: "b-1"})
	defer one.Close()
	require.Len(t, win.Vms, 1)
	assert.Empty(t, win.Hosts)

	host, win := st.Watch(Scope{HostID: "h1"})
	defer host.Close()
	assert.Empty(t, win.Vms)
	assert.Len(t, win.Hosts, 1)

	st.AddVM("bob", vmSample("b-1", "h1", 3))
	st.AddVM("alice", vmSample("a-1", "h1", 4))
	st.AddHost(&eitriv1.HostUsage{HostId: "h1", Cpus: 2})

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	ids := func(w interface {
		Next(context.Context) ([]Event, error)
	}) []string {
		evs, err := w.Next(ctx)
		require.NoError(t, err)
		var out []string
		for _, ev := range evs {
			out = append(out, ev.ID)
		}
		return out
	}
	assert.Equal(t, []string{"vm/a-1", "host/h1"}, ids(alice), "bob's VM is not alice's to hear of")
	assert.Equal(t, []string{"vm/b-1"}, ids(one))
	assert.Equal(t, []string{"host/h1"}, ids(host))
}

func TestASeriesSilentForTheSpanIsForgotten(t *testing.T) {
	st := New(0, time.Minute)
	now := time.Unix(1000, 0)
	st.now = func() time.Time { return now }
	st.AddVM("alice", vmSample("gone", "h1", 1))
	now = now.Add(30 * time.Second)
	st.AddVM("alice", vmSample("here", "h1", 1))
	now = now.Add(45 * time.Second)
	vms, _ := st.Latest()
	require.Len(t, vms, 1)
	assert.Equal(t, "here", vms[0].Usage.GetVmId())
	_, _, ok := st.Owner("gone")
	assert.False(t, ok)
}

func TestAVMOnAnotherHostStartsANewSeries(t *testing.T) {
	st := New(0, 0)
	st.AddVM("alice", vmSample("vm-1", "h1", 100))
	st.AddVM("alice", vmSample("vm-1", "h2", 1))
	w, win := st.Watch(Scope{})
	defer w.Close()
	require.Len(t, win.Vms, 1, "counters from the old host's QEMU are not mixed with the new one's")
	assert.Equal(t, "h2", win.Vms[0].GetHostId())
}

// The window costs memory per VM; this pins what a full one of 360 points
// holds, so a change that makes samples much bigger is seen.
func TestAFullFleetWindowStaysBounded(t *testing.T) {
	st := New(0, 0)
	for i := range 50 {
		for range DefaultPoints + 10 {
			st.AddVM("alice", vmSample(fmt.Sprintf("vm-%d", i), "h1", 1))
		}
	}
	w, win := st.Watch(Scope{})
	defer w.Close()
	assert.Len(t, win.Vms, 50*DefaultPoints)
}
