package fleet

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestClipCutsOnARuneBoundaryAndMarksTheCut(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"exactly10!", 10, "exactly10!"},
		{"0123456789abc", 10, "0123456…"},
		{"ééééé", 8, "éé…"}, // a cut inside é steps back to its start
	} {
		got := clip(c.in, c.n)
		assert.Equal(t, c.want, got, "clip(%q, %d)", c.in, c.n)
		assert.LessOrEqual(t, len(got), c.n)
		assert.True(t, utf8.ValidString(got))
	}
}

func TestAHostileAgentsTextIsBounded(t *testing.T) {
	huge := strings.Repeat("x", 1<<20)
	h := &eitriv1.Hello{AgentVersion: huge, Hostname: huge, Address: huge, Accelerator: huge, AcceleratorReason: huge, InstanceId: huge}
	cleanFromHost(h)
	for _, s := range []string{h.AgentVersion, h.Hostname, h.Address, h.Accelerator, h.InstanceId} {
		assert.LessOrEqual(t, len(s), maxAgentShort)
	}
	assert.LessOrEqual(t, len(h.AcceleratorReason), maxAgentLine)

	r := &eitriv1.ActualStateReport{
		AcceleratorReason: huge,
		Vms:               []*eitriv1.ActualVM{{VmId: "vm-1", StatusDetail: huge, LastError: huge, SshHostPubkey: huge, Ip: huge}},
		Exposures:         []*eitriv1.ExposureActual{{Id: "x-1", Reason: huge}},
	}
	clipReport(r)
	assert.LessOrEqual(t, len(r.AcceleratorReason), maxAgentLine)
	assert.LessOrEqual(t, len(r.Vms[0].StatusDetail), maxAgentLine)
	assert.LessOrEqual(t, len(r.Vms[0].LastError), maxAgentError)
	assert.LessOrEqual(t, len(r.Vms[0].SshHostPubkey), maxAgentPubkey)
	assert.LessOrEqual(t, len(r.Vms[0].Ip), maxAgentShort)
	assert.LessOrEqual(t, len(r.Exposures[0].Reason), maxAgentLine)
	assert.Equal(t, "vm-1", r.Vms[0].VmId, "ids are left alone: the registry matches on them")
}

func TestAGuestExitKeepsTheEndOfItsSerialTail(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{
		{"short", 10, "short"},
		{"0123456789abc", 10, "…6789abc"},
		{"ééééé", 8, "…éé"}, // a cut inside é steps forward to the next rune
	} {
		got := clipFront(c.in, c.n)
		assert.Equal(t, c.want, got, "clipFront(%q, %d)", c.in, c.n)
		assert.LessOrEqual(t, len(got), c.n)
		assert.True(t, utf8.ValidString(got))
	}
	tail := strings.Repeat("boot line\n", 1000) + "kernel panic"
	r := &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{{LastExit: &eitriv1.GuestExit{Reason: strings.Repeat("x", 1<<20), SerialTail: tail}}}}
	clipReport(r)
	x := r.Vms[0].LastExit
	assert.LessOrEqual(t, len(x.Reason), maxAgentLine)
	assert.LessOrEqual(t, len(x.SerialTail), maxAgentError)
	assert.True(t, strings.HasSuffix(x.SerialTail, "kernel panic"), "the last lines are the ones that explain")
}

func TestAHostilesProgressIsBounded(t *testing.T) {
	n := func(v uint64) *uint64 { return &v }
	for _, c := range []struct {
		name string
		in   *eitriv1.Progress
		want *eitriv1.Progress
	}{
		{"nil stays nil", nil, nil},
		{"sane numbers pass", &eitriv1.Progress{Step: "download", DoneBytes: 5, TotalBytes: n(10)}, &eitriv1.Progress{Step: "download", DoneBytes: 5, TotalBytes: n(10)}},
		{"no total passes", &eitriv1.Progress{Step: "download", DoneBytes: 5}, &eitriv1.Progress{Step: "download", DoneBytes: 5}},
		{"done = total is complete", &eitriv1.Progress{Step: "download", DoneBytes: 10, TotalBytes: n(10)}, &eitriv1.Progress{Step: "download", DoneBytes: 10, TotalBytes: n(10)}},
		{"done past total drops the total", &eitriv1.Progress{Step: "download", DoneBytes: 11, TotalBytes: n(10)}, &eitriv1.Progress{Step: "download", DoneBytes: 11}},
		{"a zero total below done is dropped too", &eitriv1.Progress{Step: "download", DoneBytes: 1, TotalBytes: n(0)}, &eitriv1.Progress{Step: "download", DoneBytes: 1}},
		{"a long step is cut to a word", &eitriv1.Progress{Step: strings.Repeat("é", 100)}, &eitriv1.Progress{Step: strings.Repeat("é", 14) + "…"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			r := &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{{VmId: "vm-1", Progress: c.in}}}
			clipReport(r)
			got := r.Vms[0].GetProgress()
			if c.want == nil {
				assert.Nil(t, got)
				return
			}
			assert.True(t, proto.Equal(c.want, got), "want %v, got %v", c.want, got)
			assert.LessOrEqual(t, len(got.GetStep()), maxAgentWord)
			assert.True(t, utf8.ValidString(got.GetStep()))
		})
	}
}

func TestAnAgentsTextLosesEveryControlCharacterButNewlinesAndTabs(t *testing.T) {
	for _, c := range []struct{ name, in, want string }{
		{"plain text is left alone", "booting, attempt 2 → é", "booting, attempt 2 → é"},
		{"newlines and tabs stay", "line 1\n\tline 2", "line 1\n\tline 2"},
		{"C0 goes: escape, bell, carriage return, NUL", "a\x1b[2Jb\x07c\r\nd\x00e", "a[2Jbc\nde"},
		{"DEL goes", "a\x7fb", "ab"},
		{"C1 goes: CSI, OSC, ST, NEL and both ends of the range", "a\u009b2Jb\u009d0;title\u009cc\u0085d\u0080e\u009ff", "a2Jb0;titlecdef"},
		{"the first character past C1 stays", "a\u00a0b", "a\u00a0b"},
	} {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.want, printable(c.in))
		})
	}

	csi := "\u009b2J\u009d0;pwned\u0007"
	r := &eitriv1.ActualStateReport{
		AcceleratorReason: "kvm" + csi,
		Vms: []*eitriv1.ActualVM{{VmId: "vm-1", StatusDetail: "booting" + csi, LastError: "failed" + csi,
			LastExit: &eitriv1.GuestExit{Reason: "exited" + csi, SerialTail: "line 1\n" + csi + "line 2"}}},
		Exposures: []*eitriv1.ExposureActual{{Id: "x-1", Reason: "refused" + csi}},
	}
	clipReport(r)
	v := r.Vms[0]
	for _, s := range []string{r.AcceleratorReason, v.StatusDetail, v.LastError, v.LastExit.Reason, v.LastExit.SerialTail, r.Exposures[0].Reason} {
		assert.NotContains(t, s, "\u009b")
		assert.NotContains(t, s, "\u009d")
		assert.NotContains(t, s, "\a")
	}
	assert.Equal(t, "line 1\n2J0;pwnedline 2", v.LastExit.SerialTail)
}
