package api_test

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// A mixed fleet is normal during a rollout: a peer must skip a field it has
// never heard of and keep every field it knows.
func TestAReportFromANewerAgentDecodesOnAnOlderServer(t *testing.T) {
	vm, err := proto.Marshal(&eitriv1.ActualVM{VmId: "vm-1", Power: "stopped", Phase: "creating", StatusDetail: "booting"})
	require.NoError(t, err)
	vm = protowire.AppendTag(vm, 99, protowire.BytesType)
	vm = protowire.AppendString(vm, "a field from a later release")

	exp, err := proto.Marshal(&eitriv1.ExposureActual{Id: "x-1", State: "active", Sessions: &eitriv1.ExposureSessions{Active: 7, Refused: 12, Dropped: 3}})
	require.NoError(t, err)
	exp = protowire.AppendTag(exp, 42, protowire.VarintType)
	exp = protowire.AppendVarint(exp, 1)

	// Hand-assemble the report so the unknown fields sit inside nested rows.
	var rep []byte
	rep = protowire.AppendTag(rep, 1, protowire.BytesType)
	rep = protowire.AppendBytes(rep, vm)
	rep = protowire.AppendTag(rep, 6, protowire.BytesType)
	rep = protowire.AppendBytes(rep, exp)

	var got eitriv1.ActualStateReport
	require.NoError(t, proto.Unmarshal(rep, &got), "an unknown field must not fail the frame")
	require.Len(t, got.Vms, 1)
	assert.Equal(t, "vm-1", got.Vms[0].VmId)
	assert.Equal(t, "creating", got.Vms[0].Phase)
	assert.Equal(t, "booting", got.Vms[0].StatusDetail)
	require.Len(t, got.Exposures, 1)
	assert.Equal(t, int64(12), got.Exposures[0].GetSessions().GetRefused())
}

// An agent older than the counters sends no sessions: that must decode as
// absent (nil, JSON null), never as a zeroed message.
func TestAReportFromAnOlderAgentReadsAsSilence(t *testing.T) {
	// What an old agent put on the wire: exposure rows with id, state, reason.
	var row []byte
	row = protowire.AppendTag(row, 1, protowire.BytesType)
	row = protowire.AppendString(row, "x-1")
	row = protowire.AppendTag(row, 2, protowire.BytesType)
	row = protowire.AppendString(row, "active")
	var rep []byte
	rep = protowire.AppendTag(rep, 6, protowire.BytesType)
	rep = protowire.AppendBytes(rep, row)

	var got eitriv1.ActualStateReport
	require.NoError(t, proto.Unmarshal(rep, &got))
	require.Len(t, got.Exposures, 1)
	assert.Nil(t, got.Exposures[0].Sessions, "an uncounted port must not decode as zeros")
	assert.Empty(t, got.Exposures[0].Reason)

	// And the API's JSON says null for it.
	b, err := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(&eitriv1.Exposure{Id: "x-1"})
	require.NoError(t, err)
	assert.Contains(t, string(b), `"sessions":null`)
}
