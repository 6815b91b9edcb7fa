package intake

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

var rules = Rules{
	DefaultText:  Text{Max: 16},
	DefaultItems: 3,
	DefaultBytes: 8,
	Text: map[protoreflect.FullName]Text{
		"eitri.v1.ActualVM.last_error":   {Max: 32, Lines: true},
		"eitri.v1.GuestExit.serial_tail": {Max: 12, Lines: true, Tail: true},
	},
	Items: map[protoreflect.FullName]int{"eitri.v1.ActualStateReport.destroyed": 1},
}

func TestTextIsBoundedAndCleaned(t *testing.T) {
	for _, c := range []struct {
		name, field, in, want string
	}{
		{"short and clean", "ip", "10.0.0.2", "10.0.0.2"},
		{"past the default bound", "ip", strings.Repeat("a", 40), strings.Repeat("a", 13) + "…"},
		{"a terminal escape", "ip", "a\x1b[2Jb", "a[2Jb"},
		{"a C1 CSI", "ip", "a\u009b2Jb", "a2Jb"},
		{"newlines where lines are not kept", "ip", "a\nb\tc", "abc"},
		{"newlines where they are", "last_error", "a\nb\tc\x07", "a\nb\tc"},
		{"invalid UTF-8", "ip", "a\xffb", "a\ufffdb"},
		{"a NUL", "ip", "a\x00b", "ab"},
		{"a rune never cut in half", "ip", strings.Repeat("é", 10), strings.Repeat("é", 6) + "…"},
	} {
		t.Run(c.name, func(t *testing.T) {
			vm := &eitriv1.ActualVM{}
			fd := vm.ProtoReflect().Descriptor().Fields().ByName(protoreflect.Name(c.field))
			vm.ProtoReflect().Set(fd, protoreflect.ValueOfString(c.in))
			rules.Clean(vm)
			assert.Equal(t, c.want, vm.ProtoReflect().Get(fd).String())
		})
	}
}

func TestATailKeepsItsEnd(t *testing.T) {
	x := &eitriv1.GuestExit{SerialTail: "boot\nlots of lines\nKernel panic"}
	rules.Clean(x)
	assert.Equal(t, "…nel panic", x.GetSerialTail()) // the last 12 bytes, "…" included
}

func TestNestedListsAndUnknownFieldsAreBounded(t *testing.T) {
	rep := &eitriv1.ActualStateReport{Destroyed: []string{"a", "b", "c"}, Accelerator: "kvm\x1b]0;x\x07"}
	for i := range 5 {
		rep.Vms = append(rep.Vms, &eitriv1.ActualVM{VmId: strings.Repeat("v", i+20),
			LastExit: &eitriv1.GuestExit{Reason: "oom\x1b"}})
	}
	// Fields no message defines, as a hostile host would send: at the top
	// and inside a nested message.
	junk := protowire.AppendTag(nil, 999, protowire.BytesType)
	junk = protowire.AppendBytes(junk, make([]byte, 1<<20))
	rep.ProtoReflect().SetUnknown(junk)
	rep.Vms[0].LastExit.ProtoReflect().SetUnknown(junk)
	rep.Metrics = &eitriv1.Metrics{Load1: 1}
	rep.Metrics.ProtoReflect().SetUnknown(junk)

	rules.Clean(rep)

	assert.Len(t, rep.GetVms(), 3, "the default item bound")
	assert.Equal(t, []string{"a"}, rep.GetDestroyed(), "a field's own bound")
	assert.Equal(t, "kvm]0;x", rep.GetAccelerator())
	for _, v := range rep.GetVms() {
		assert.LessOrEqual(t, len(v.GetVmId()), 16)
		assert.Equal(t, "oom", v.GetLastExit().GetReason())
	}
	b, err := proto.Marshal(rep)
	require.NoError(t, err)
	assert.Less(t, len(b), 1024, "no unknown field is left anywhere")
	assert.Equal(t, 1.0, rep.GetMetrics().GetLoad1())
}

func TestBytesAreBounded(t *testing.T) {
	q := &eitriv1.QuarantinedVM{VmspecJson: []byte("0123456789abcdef")}
	rules.Clean(q)
	assert.Equal(t, []byte("01234567"), q.GetVmspecJson())
}

func TestNilAndEmptyAreLeftAlone(t *testing.T) {
	rules.Clean(nil)
	var rep *eitriv1.ActualStateReport
	rules.Clean(rep)
	empty := &eitriv1.ActualStateReport{}
	rules.Clean(empty)
	assert.True(t, proto.Equal(empty, &eitriv1.ActualStateReport{}))
}

func TestClipEdges(t *testing.T) {
	for _, c := range []struct {
		in   string
		n    int
		want string
	}{
		{"abc", 0, "abc"},
		{"abc", 3, "abc"},
		{"abcd", 3, "…"},
		{"abcdef", 4, "a…"},
	} {
		assert.Equal(t, c.want, Clip(c.in, c.n), "Clip(%q, %d)", c.in, c.n)
	}
	assert.Equal(t, "…ef", ClipFront("abcdef", 5))
}
