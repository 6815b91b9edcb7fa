package mcp_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	eitrimcp "github.com/a73x/eitri/server/mcp"
)

func TestExposureListCarriesTheBytesAHostCountedAndNullForWhatItDidNot(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	vm := adminVM(t, e, "web-1")
	cs := connect(t, e, nil)
	create := func(port int) string {
		return ok[eitrimcp.ExposureOut](t, cs, "exposure_create", map[string]any{"vm_id": vm.GetId(), "guest_port": port}).Exposure.ID
	}
	web, dns, ssh := create(80), create(53), create(22)
	h.sess.Apply(context.Background(), &eitriv1.ActualStateReport{
		Capacity: &eitriv1.Capacity{Vcpus: 8, MemMb: 16384, DiskGb: 200},
		Vms:      []*eitriv1.ActualVM{{VmId: vm.GetId(), Power: "running", Phase: "ready"}},
		Exposures: []*eitriv1.ExposureActual{
			{Id: web, State: "active", Sessions: &eitriv1.ExposureSessions{Active: 2, Refused: 1, Dropped: 3,
				Carried: &eitriv1.ExposureBytes{In: 4096, Out: 1 << 40}}},
			{Id: dns, State: "active", Sessions: &eitriv1.ExposureSessions{Carried: &eitriv1.ExposureBytes{}}},
			{Id: ssh, State: "active", Sessions: &eitriv1.ExposureSessions{Active: 1}},
		},
	})

	byID := map[string]eitrimcp.Exposure{}
	for _, x := range ok[eitrimcp.ExposureListOut](t, cs, "exposure_list", map[string]any{"vm_id": vm.GetId()}).Exposures {
		byID[x.ID] = x
	}
	require.Len(t, byID, 3)
	require.NotNil(t, byID[web].Sessions)
	assert.Equal(t, &eitrimcp.ExposureSessions{Active: 2, Refused: 1, Dropped: 3,
		Carried: &eitrimcp.ExposureBytes{In: 4096, Out: 1 << 40}}, byID[web].Sessions)
	require.NotNil(t, byID[dns].Sessions)
	assert.Equal(t, &eitrimcp.ExposureBytes{}, byID[dns].Sessions.Carried, "a counted zero is a zero")

	// What the client receives: carried is there and null for a host that
	// counts sessions but not bytes, not an object of zeros.
	raw := ok[map[string]any](t, cs, "exposure_list", map[string]any{"vm_id": vm.GetId()})["exposures"].([]any)
	sessionsOf := map[string]map[string]any{}
	for _, x := range raw {
		x := x.(map[string]any)
		sessionsOf[x["id"].(string)] = x["sessions"].(map[string]any)
	}
	assert.Contains(t, sessionsOf[ssh], "carried")
	assert.Nil(t, sessionsOf[ssh]["carried"])
	assert.Equal(t, map[string]any{"in": float64(0), "out": float64(0)}, sessionsOf[dns]["carried"])
	assert.Equal(t, map[string]any{"in": float64(4096), "out": float64(1 << 40)}, sessionsOf[web]["carried"])
}
