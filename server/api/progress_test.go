package api_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func bytesOf(n uint64) *uint64 { return &n }

// What a host measures reaches a watcher as numbers on the VM, bounded when
// the host is hostile, and null (never zeros) when it measures nothing.
func TestAHostsProgressReachesWatchersAsNumbers(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())

	watch, err := e.vms(e.admin).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	defer watch.Close()
	require.True(t, watch.Receive())

	created, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	id := created.Msg.Vm.Id
	assert.Nil(t, created.Msg.Vm.Progress, "nobody has measured anything yet")
	a.next(t)

	// seen waits for the watcher's view of the VM saying detail: the
	// report it answers to.
	seen := func(detail string) *eitriv1.VM {
		t.Helper()
		for watch.Receive() {
			if v := watch.Msg().GetChanged(); v.GetId() == id && v.GetStatusDetail() == detail {
				return v
			}
		}
		t.Fatalf("the watch ended before %q: %v", detail, watch.Err())
		return nil
	}

	for _, c := range []struct {
		name   string
		detail string
		sent   *eitriv1.Progress
		want   *eitriv1.Progress
	}{
		{
			"a download of known size",
			"downloading image 1.2/3.7 GiB",
			&eitriv1.Progress{Step: "download", DoneBytes: 1_288_490_188, TotalBytes: bytesOf(3_972_844_748)},
			&eitriv1.Progress{Step: "download", DoneBytes: 1_288_490_188, TotalBytes: bytesOf(3_972_844_748)},
		},
		{
			"a server that sent no length",
			"downloading image 2.0 GiB",
			&eitriv1.Progress{Step: "download", DoneBytes: 2 << 30},
			&eitriv1.Progress{Step: "download", DoneBytes: 2 << 30},
		},
		{
			"done past the total: the total is not believed",
			"downloading image 9.0/1.0 GiB",
			&eitriv1.Progress{Step: "download", DoneBytes: 9 << 30, TotalBytes: bytesOf(1 << 30)},
			&eitriv1.Progress{Step: "download", DoneBytes: 9 << 30},
		},
		{
			"done equal to the total is whole, not hostile",
			"downloading image 1.0/1.0 GiB",
			&eitriv1.Progress{Step: "download", DoneBytes: 1 << 30, TotalBytes: bytesOf(1 << 30)},
			&eitriv1.Progress{Step: "download", DoneBytes: 1 << 30, TotalBytes: bytesOf(1 << 30)},
		},
		{
			"nothing measured: null, not zeros",
			"preparing root disk",
			nil,
			nil,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{
				{VmId: id, Power: "stopped", Phase: "creating", StatusDetail: c.detail, Progress: c.sent},
			}})
			v := seen(c.detail)
			if c.want == nil {
				assert.Nil(t, v.Progress)
				return
			}
			assert.True(t, proto.Equal(c.want, v.Progress), "want %v, got %v", c.want, v.Progress)
		})
	}

	t.Run("a step of a megabyte is cut to a word", func(t *testing.T) {
		huge := strings.Repeat("x", 1<<20)
		a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{
			{VmId: id, Power: "stopped", Phase: "creating", StatusDetail: "hostile", Progress: &eitriv1.Progress{Step: huge, DoneBytes: 5}},
		}})
		v := seen("hostile")
		require.NotNil(t, v.Progress)
		assert.LessOrEqual(t, len(v.Progress.Step), 32)
		assert.True(t, strings.HasPrefix(v.Progress.Step, "xxx"))
		assert.Equal(t, uint64(5), v.Progress.DoneBytes)
	})

	// In JSON: an object with the numbers while measured, null otherwise.
	t.Run("json", func(t *testing.T) {
		a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{
			{VmId: id, Power: "stopped", Phase: "creating", StatusDetail: "downloading image 0.5 GiB", Progress: &eitriv1.Progress{Step: "download", DoneBytes: 1 << 29}},
		}})
		seen("downloading image 0.5 GiB")
		status, out := e.postJSON("/eitri.v1.VMService/GetVM", map[string]any{"id": id})
		require.Equal(t, 200, status, out)
		p, ok := out["vm"].(map[string]any)["progress"].(map[string]any)
		require.True(t, ok, "%v", out["vm"])
		assert.Equal(t, "download", p["step"])
		assert.Equal(t, "536870912", p["done_bytes"])
		assert.Nil(t, p["total_bytes"], "an unknown total is not 0")

		a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{
			{VmId: id, Power: "running", Phase: "ready", Ip: "10.77.0.5"},
		}})
		seen("")
		status, out = e.postJSON("/eitri.v1.VMService/GetVM", map[string]any{"id": id})
		require.Equal(t, 200, status, out)
		vm := out["vm"].(map[string]any)
		assert.Contains(t, vm, "progress")
		assert.Nil(t, vm["progress"], "a settled VM's progress is null")
	})
}
