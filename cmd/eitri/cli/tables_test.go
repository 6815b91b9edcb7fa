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

func TestTheExposureTableShowsBytesCarriedAndDashesWhatWasNotCounted(t *testing.T) {
	var out bytes.Buffer
	exposureTable(&out,
		&eitriv1.Exposure{Id: "e-1", VmId: "v-1", HostAddr: "192.0.2.1", HostPort: 8080, Protocol: "tcp", GuestPort: 80, State: "active",
			Sessions: &eitriv1.ExposureSessions{Active: 2, Refused: 1, Carried: &eitriv1.ExposureBytes{In: 1536, Out: 3 << 20}}},
		&eitriv1.Exposure{Id: "e-2", VmId: "v-1", HostPort: 5353, Protocol: "udp", GuestPort: 53, State: "active",
			Sessions: &eitriv1.ExposureSessions{Carried: &eitriv1.ExposureBytes{}}},
		&eitriv1.Exposure{Id: "e-3", VmId: "v-1", HostPort: 2222, Protocol: "tcp", GuestPort: 22, State: "active",
			Sessions: &eitriv1.ExposureSessions{Active: 1}},
		&eitriv1.Exposure{Id: "e-4", VmId: "v-1", HostPort: 9000, Protocol: "tcp", GuestPort: 9000, State: "pending"},
	)
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 5)
	cols := func(i int) []string { return strings.Split(lines[i], "\t") }
	require.Equal(t, []string{"ID", "VM", "PUBLISHED", "GUEST", "STATE", "IN", "OUT", "SESSIONS"}, cols(0))

	assert.Equal(t, []string{"1.5 KiB", "3.0 MiB"}, cols(1)[5:7])
	assert.Equal(t, "2 open · 1 refused, 0 dropped since agent start", cols(1)[7])
	assert.Equal(t, []string{"0 B", "0 B"}, cols(2)[5:7], "a counted zero is a fact and shows as one")
	assert.Equal(t, []string{"—", "—"}, cols(3)[5:7], "a host that counts sessions but not bytes shows no bytes")
	assert.Equal(t, "1 open · 0 refused, 0 dropped since agent start", cols(3)[7])
	assert.Equal(t, []string{"—", "—", "—"}, cols(4)[5:8], "a port its host has not reported on shows no counters at all")
}
