package cli

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vbauerster/mpb/v8"

	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

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
			var out outputtest.Buffer
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
			t.Logf("%q", outputtest.StripANSI(text))
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
			outputtest.LinesInOrder(t, text, c.lines)
			for _, a := range c.absent {
				assert.NotContains(t, text, a, "the failure is the command's error, not said twice")
			}
			assert.Equal(t, 1, strings.Count(text, "creating: downloading image"), "one line for the step, however often its sentence changed")
		})
	}
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
	outputtest.LinesInOrder(t, text, []string{
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
