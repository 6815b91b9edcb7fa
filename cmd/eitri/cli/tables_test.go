package cli

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestHostLsSaysWhyAndWhatIsWrong(t *testing.T) {
	var out bytes.Buffer
	hostTable(&out, &eitriv1.Host{
		Id: "h-1", Name: "rack1", Connected: true, Accelerator: "tcg",
		AcceleratorReason: "kvm unusable: failed to set MSR 0x10a; running under tcg",
		Conditions:        []*eitriv1.HostCondition{{Type: "duplicate_agent", Message: "a second agent keeps connecting from 192.0.2.9:4711"}},
	}, &eitriv1.Host{Id: "h-2", Name: "rack2"})
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 3)
	assert.Contains(t, lines[0], "NOTES")
	assert.Contains(t, lines[1], "DUPLICATE AGENT: a second agent keeps connecting from 192.0.2.9:4711; kvm unusable: failed to set MSR 0x10a; running under tcg")
	assert.NotContains(t, lines[2], "kvm", "a host with nothing to say has an empty note")
}

func TestADeletedVMSaysUntilWhenItCanBeRestoredThenWhenItIsDestroyed(t *testing.T) {
	until := time.Now().Add(time.Hour)
	v := &eitriv1.VM{Deleted: true, Lifecycle: "deleting", RestorableUntil: timestamppb.New(until), DestroyAt: timestamppb.New(until.Add(time.Minute))}
	assert.Equal(t, "restorable until "+when(until), statusLine(v))
	v.RestorableUntil = timestamppb.New(time.Now().Add(-time.Second))
	assert.Equal(t, "destroyed at "+when(until.Add(time.Minute)), statusLine(v), "no Restore is offered once it cannot work")
}
