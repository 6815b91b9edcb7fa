package main

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/agent/syncclient"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

const mib = 1 << 20

// scriptedHost is a host on the real sync stream whose VMs say what the
// test sets: it reports row(d) for each VM it holds.
type scriptedHost struct {
	mu  sync.Mutex
	vms []*eitriv1.VMDesired
	// images are the images the last snapshot wanted; each is reported held.
	images []*eitriv1.ImageWanted
	row    func(d *eitriv1.VMDesired) *eitriv1.ActualVM
	// id is the host's enrollment (its credential opens AgentService).
	id state.Identity
}

func (h *scriptedHost) Apply(s *eitriv1.DesiredStateSnapshot) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.vms = s.GetVms()
	h.images = s.GetImages()
	return true
}

func (h *scriptedHost) Fill(rep *eitriv1.ActualStateReport) {
	h.mu.Lock()
	defer h.mu.Unlock()
	rep.Capacity = &eitriv1.Capacity{Vcpus: 16, MemMb: 65536, DiskGb: 1000}
	for _, w := range h.images { // pulled at once
		rep.Images = append(rep.Images, &eitriv1.ImageHeld{Sha256: w.GetSha256(), Held: true})
	}
	for _, d := range h.vms {
		if h.row != nil {
			rep.Vms = append(rep.Vms, h.row(d))
		}
	}
}

func (h *scriptedHost) set(row func(d *eitriv1.VMDesired) *eitriv1.ActualVM) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.row = row
}

// connectHost enrolls a scripted host and keeps its stream up for the
// test.
func (e *cliEnv) connectHost(name string) *scriptedHost {
	e.t.Helper()
	id := e.enroll(name)
	h := &scriptedHost{id: id}
	ctx, cancel := context.WithCancel(context.Background())
	e.t.Cleanup(cancel)
	go func() {
		_ = syncclient.Run(ctx, syncclient.Config{Identity: id, Source: h, ReportEvery: 10 * time.Millisecond,
			Hello: func() *eitriv1.Hello { return &eitriv1.Hello{AgentVersion: "test"} }})
	}()
	require.Eventually(e.t, func() bool {
		out, err := e.eitri("host", "get", name, "-o", "json")
		var r eitriv1.GetHostResponse
		return err == nil && protojson.Unmarshal([]byte(out), &r) == nil && r.Host.Connected && r.Host.Capacity != nil
	}, 10*time.Second, 10*time.Millisecond, "the host is connected and has reported its capacity (VMs can be placed)")
	return h
}

// background runs a command line until it ends; its output is readable
// meanwhile.
func background(args ...string) (out *outputtest.Buffer, done chan error) {
	out, done = &outputtest.Buffer{}, make(chan error, 1)
	go func() {
		done <- execute(context.Background(), args, cli.IO{In: strings.NewReader(""), Out: out, Err: out})
	}()
	return out, done
}

func TestVMCreateWaitNarratesEachStepUntilReadyOrFailed(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	h := e.connectHost("h1")
	image := []string{"--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32)}
	step := func(phase, detail string) {
		h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
			row := &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "stopped", Phase: phase, StatusDetail: detail}
			if strings.HasPrefix(detail, "downloading") {
				total := uint64(72 * mib)
				row.Progress = &eitriv1.Progress{Step: "download", DoneBytes: 8 * mib, TotalBytes: &total}
			}
			return row
		})
	}

	step("creating", "waiting for a create slot on this host")
	out, done := background(append([]string{"vm", "create", "web-1", "--wait"}, image...)...)
	// Each step is held until the command has said it, so no step can be
	// missed in between.
	for _, s := range []string{"waiting for a create slot on this host", "downloading image 8/72 MiB", "preparing root disk", "booting"} {
		step("creating", s)
		require.Eventually(t, func() bool {
			select {
			case err := <-done:
				require.NoError(t, err, "the command ended early")
			default:
			}
			return strings.Contains(out.String(), "creating: "+s)
		}, 10*time.Second, 5*time.Millisecond, "%q is said:\n%s", s, out)
	}
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "running", Phase: "ready", Ip: "10.77.0.9"}
	})
	select {
	case err := <-done:
		require.NoError(t, err, out.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("vm create --wait did not return once the VM was ready:\n%s", out.String())
	}
	text := out.String()
	t.Logf("\n%s", text)
	assert.Regexp(t, `^created web-1 \(vm-\S+\) on h-\S+\n`, text)
	outputtest.LinesInOrder(t, text, []string{"creating: waiting for a create slot on this host", "creating: downloading image 8/72 MiB",
		// Not a terminal: the measure as a line, from VM.progress.
		"download 8.0 MiB / 72.0 MiB (11%)",
		"creating: preparing root disk", "creating: booting", "ready at 10.77.0.9"})
	assert.True(t, strings.HasSuffix(text, "ready at 10.77.0.9\n"), "the address is the last thing said")

	// A failure is the command's error (exit 1), after the steps.
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		if d.GetName() == "web-1" {
			return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "running", Phase: "ready", Ip: "10.77.0.9"}
		}
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "stopped", Phase: "failed", LastError: "image: GET http://images.test/nope.raw: 404 Not Found"}
	})
	out, done = background(append([]string{"vm", "create", "bad-1", "--wait", "-o", "json"}, image...)...)
	err := <-done
	require.Error(t, err)
	assert.Equal(t, "bad-1 failed: image: GET http://images.test/nope.raw: 404 Not Found", err.Error())

	// vm wait on a VM already at rest answers at once; by name.
	got, err := e.eitri("vm", "wait", "web-1", "-o", "json")
	require.NoError(t, err)
	var vm eitriv1.GetVMResponse
	require.NoError(t, protojson.Unmarshal([]byte(got), &vm), got)
	assert.Equal(t, "ready", vm.Vm.Lifecycle, "under -o json stdout is the settled VM alone")
	assert.Equal(t, "10.77.0.9", vm.Vm.AssignedIp)

	// stop --wait follows the VM to stopped.
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: d.GetPowerState(), Phase: map[string]string{"running": "ready", "stopped": "stopped"}[d.GetPowerState()], Ip: "10.77.0.9"}
	})
	got, err = e.eitri("vm", "stop", "web-1", "--wait")
	require.NoError(t, err)
	assert.Contains(t, got, "stopped")

	_, err = e.eitri("vm", "wait", "nope")
	assert.EqualError(t, err, `no VM has the id or name "nope"`)
}
