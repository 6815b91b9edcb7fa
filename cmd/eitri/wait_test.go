package main

import (
	"bytes"
	"context"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vbauerster/mpb/v8"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/agent/syncclient"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

// syncBuffer is a buffer a command writes to while the test reads it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// clock is a test's time: each reading is a second after the last.
type clock struct{ t time.Time }

func (c *clock) now() time.Time {
	c.t = c.t.Add(time.Second)
	return c.t
}

const mib = 1 << 20

// downloading is a creating VM whose host measures its download.
func downloading(done uint64, total *uint64) *eitriv1.VM {
	return &eitriv1.VM{Id: "vm-1", Name: "web-1", Lifecycle: "creating", StatusDetail: "downloading image",
		Progress: &eitriv1.Progress{Step: "download", DoneBytes: done, TotalBytes: total}}
}

func creating(detail string) *eitriv1.VM {
	return &eitriv1.VM{Id: "vm-1", Name: "web-1", Lifecycle: "creating", StatusDetail: detail}
}

var ready = &eitriv1.VM{Id: "vm-1", Name: "web-1", Lifecycle: "ready", AssignedIp: "10.77.0.2", ActualPower: "running"}

// feed shows the narrator each VM in turn, as WatchVMs would push them,
// and returns whether the last settled it and how.
func feed(t *testing.T, n *narrator, vms ...*eitriv1.VM) (bool, error) {
	t.Helper()
	var done bool
	var err error
	for i, v := range vms {
		done, err = n.see(v)
		if i < len(vms)-1 {
			require.False(t, done, "settled early, at %d", i)
		}
	}
	return done, err
}

func TestTheProgressBarIsDrawnFromVMProgress(t *testing.T) {
	total := uint64(64 * mib)
	cases := []struct {
		name   string
		vms    []*eitriv1.VM
		err    string
		frame  []string // in the bar's last frame
		lines  []string // step lines, in order
		absent []string
	}{{
		name: "a download at 8 MiB/s that completes",
		vms: []*eitriv1.VM{
			creating("waiting for a create slot on this host"),
			downloading(0, &total), downloading(8*mib, &total), downloading(16*mib, &total), downloading(32*mib, &total),
			creating("preparing root disk"), creating("booting"), ready,
		},
		// The sentence changed with every report; the bar moved instead.
		lines: []string{"creating: waiting for a create slot on this host", "creating: downloading image", "creating: preparing root disk", "creating: booting", "ready at 10.77.0.2"},
		frame: []string{"download", "64.0 MiB / 64.0 MiB", "100 %"},
	}, {
		name:  "a download that fails halfway stays drawn where it stopped, with its rate and time left",
		vms:   []*eitriv1.VM{downloading(0, &total), downloading(16*mib, &total), downloading(32*mib, &total), {Id: "vm-1", Name: "web-1", Lifecycle: "failed", LastError: "image: unexpected EOF"}},
		err:   "web-1 failed: image: unexpected EOF",
		lines: []string{"creating: downloading image", "failed"},
		// 16 MiB a second, 32 MiB to go.
		frame:  []string{"32.0 MiB / 64.0 MiB", "50 %", "16.0 MiB/s", "ETA 2s"},
		absent: []string{"unexpected EOF"},
	}, {
		name:  "an unknown total shows the bytes so far and the rate",
		vms:   []*eitriv1.VM{downloading(0, nil), downloading(4*mib, nil), downloading(8*mib, nil), {Id: "vm-1", Name: "web-1", Lifecycle: "failed", LastError: "boom"}},
		err:   "web-1 failed: boom",
		lines: []string{"creating: downloading image", "failed"},
		frame: []string{"download", "8.0 MiB", "4.0 MiB/s"},
	}}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var out syncBuffer
			// The bar renders when told (and once when it ends), to a fixed
			// width, so the last frame is the state after the last VM.
			refresh := make(chan any)
			n := &narrator{w: &out, now: (&clock{}).now,
				meter: &barMeter{w: &out, opts: []mpb.ContainerOption{mpb.WithManualRefresh(refresh), mpb.WithWidth(120)}}}
			done, err := feed(t, n, c.vms...)
			n.stop()
			require.True(t, done)
			if c.err != "" {
				require.EqualError(t, err, c.err)
			} else {
				require.NoError(t, err)
			}
			text := out.String()
			t.Logf("%q", stripANSI(text))
			frames := strings.Split(text, "\n")
			var last string
			for _, f := range frames {
				if strings.Contains(f, "download ") && !strings.Contains(f, "downloading") {
					last = f
				}
			}
			for _, want := range c.frame {
				assert.Contains(t, last, want, "the bar's last frame: %q", last)
			}
			assertLinesInOrder(t, text, c.lines)
			for _, a := range c.absent {
				assert.NotContains(t, text, a, "the failure is the command's error, not said twice")
			}
			assert.Equal(t, 1, strings.Count(text, "creating: downloading image"), "one line for the step, however often its sentence changed")
		})
	}
}

// assertLinesInOrder checks that each of want is in a line of text, in
// order, each line after a time of day.
func assertLinesInOrder(t *testing.T, text string, want []string) {
	t.Helper()
	stamped := regexp.MustCompile(`^\d\d:\d\d:\d\d (.*)$`)
	var got []string
	for _, l := range strings.Split(text, "\n") {
		if m := stamped.FindStringSubmatch(strings.TrimSpace(stripANSI(l))); m != nil {
			got = append(got, m[1])
		}
	}
	i := 0
	for _, g := range got {
		if i < len(want) && strings.Contains(g, want[i]) {
			i++
		}
	}
	assert.Equal(t, len(want), i, "step lines in order: want %q, got %q", want, got)
}

func stripANSI(s string) string {
	return regexp.MustCompile(`\x1b\[[0-9;?]*[A-Za-z]`).ReplaceAllString(s, "")
}

func TestWithoutATerminalProgressIsPlainLines(t *testing.T) {
	total := uint64(100 * mib)
	var vms []*eitriv1.VM
	vms = append(vms, creating("waiting for a create slot on this host"))
	for done := uint64(0); done <= 100*mib; done += 5 * mib {
		vms = append(vms, downloading(done, &total))
	}
	vms = append(vms, creating("booting"), ready)
	var out bytes.Buffer
	n := &narrator{w: &out, now: (&clock{}).now, meter: &lineMeter{w: &out}}
	done, err := feed(t, n, vms...)
	require.True(t, done)
	require.NoError(t, err)
	text := out.String()
	t.Logf("\n%s", text)
	assert.NotContains(t, text, "\x1b", "no terminal escapes in a log")
	assertLinesInOrder(t, text, []string{
		"creating: downloading image",
		"download 0 B / 100.0 MiB (0%)",
		"download 10.0 MiB / 100.0 MiB (10%), 5.0 MiB/s, 18s left",
		"download 50.0 MiB / 100.0 MiB (50%), 5.0 MiB/s, 10s left",
		"download 100.0 MiB / 100.0 MiB (100%), 5.0 MiB/s",
		"creating: booting",
		"ready at 10.77.0.2",
	})
	// A line per tenth, not per report: 21 reports, 11 lines.
	assert.Equal(t, 11, strings.Count(text, " download "), text)
}

func TestAWaitSettlesOnlyWhereAVMComesToRest(t *testing.T) {
	cases := []struct {
		lifecycle string
		settled   bool
		err       string
	}{
		{"pending", false, ""}, {"creating", false, ""}, {"starting", false, ""}, {"stopping", false, ""},
		{"retrying", false, ""}, {"restoring", false, ""}, {"unknown", false, ""},
		{"ready", true, ""}, {"stopped", true, ""},
		{"failed", true, "web-1 failed: disk full"}, {"lost", true, "web-1 is lost: disk full"}, {"deleting", true, "web-1 is being deleted"},
	}
	for _, c := range cases {
		done, err := settled(&eitriv1.VM{Name: "web-1", Lifecycle: c.lifecycle, LastError: "disk full"})
		assert.Equal(t, c.settled, done, c.lifecycle)
		if c.err == "" {
			assert.NoError(t, err, c.lifecycle)
		} else {
			assert.EqualError(t, err, c.err, c.lifecycle)
		}
	}
}

// scriptedHost is a host on the real sync stream whose VMs say what the
// test sets: it reports row(d) for each VM it holds.
type scriptedHost struct {
	mu  sync.Mutex
	vms []*eitriv1.VMDesired
	row func(d *eitriv1.VMDesired) *eitriv1.ActualVM
	// id is the host's enrollment (its credential opens AgentService).
	id state.Identity
}

func (h *scriptedHost) Apply(s *eitriv1.DesiredStateSnapshot) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.vms = s.GetVms()
	return true
}

func (h *scriptedHost) Fill(rep *eitriv1.ActualStateReport) {
	h.mu.Lock()
	defer h.mu.Unlock()
	rep.Capacity = &eitriv1.Capacity{Vcpus: 16, MemMb: 65536, DiskGb: 1000}
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
func background(args ...string) (out *syncBuffer, done chan error) {
	out, done = &syncBuffer{}, make(chan error, 1)
	go func() {
		done <- execute(context.Background(), args, stdio{in: strings.NewReader(""), out: out, err: out})
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
	assertLinesInOrder(t, text, []string{"creating: waiting for a create slot on this host", "creating: downloading image 8/72 MiB",
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
