package registry

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestApplyReportsOnlyWhatChanged(t *testing.T) {
	r := New()
	now := time.Now()
	conn, _ := r.Connect("h1", &eitriv1.Hello{HostId: "h1"}, now)

	d, ok := r.Apply("h1", conn, &eitriv1.ActualStateReport{
		Vms: []*eitriv1.ActualVM{{VmId: "a", Phase: "creating"}, {VmId: "b", Phase: "ready"}},
	}, now)
	require.True(t, ok)
	assert.ElementsMatch(t, []string{"a", "b"}, d.VMs)
	assert.True(t, d.Host, "the first report is news about the host")

	d, _ = r.Apply("h1", conn, &eitriv1.ActualStateReport{
		Vms: []*eitriv1.ActualVM{{VmId: "a", Phase: "creating", StatusDetail: "booting"}, {VmId: "b", Phase: "ready"}},
	}, now)
	assert.Equal(t, []string{"a"}, d.VMs)
	assert.False(t, d.Host)

	d, _ = r.Apply("h1", conn, &eitriv1.ActualStateReport{
		Vms: []*eitriv1.ActualVM{{VmId: "a", Phase: "creating", StatusDetail: "booting"}},
	}, now)
	assert.Equal(t, []string{"b"}, d.VMs, "a VM missing from a complete report changed too")
	row, reporting := r.VM("h1", "b")
	assert.True(t, reporting)
	assert.Nil(t, row)
}

func TestExposureSessionsStayNilWhenNotCounted(t *testing.T) {
	r := New()
	conn, _ := r.Connect("h1", nil, time.Now())
	r.Apply("h1", conn, &eitriv1.ActualStateReport{Exposures: []*eitriv1.ExposureActual{
		{Id: "counted", State: "active", Sessions: &eitriv1.ExposureSessions{Active: 7, Refused: 12, Dropped: 3}},
		{Id: "silent", State: "active"},
	}}, time.Now())
	assert.Equal(t, int64(12), r.Exposure("h1", "counted").GetSessions().GetRefused())
	assert.Nil(t, r.Exposure("h1", "silent").GetSessions(), "no counters is not zero counters")
}

func TestAReplacedStreamCannotApplyOrDisconnect(t *testing.T) {
	r := New()
	old, _ := r.Connect("h1", nil, time.Now())
	cur, _ := r.Connect("h1", nil, time.Now())
	_, ok := r.Apply("h1", old, &eitriv1.ActualStateReport{}, time.Now())
	assert.False(t, ok)
	_, ok = r.Disconnect("h1", old)
	assert.False(t, ok)
	assert.True(t, r.Connected("h1"))
	_, ok = r.Disconnect("h1", cur)
	assert.True(t, ok)
	assert.False(t, r.Connected("h1"))
}

func TestDisconnectTouchesEveryLiveObject(t *testing.T) {
	r := New()
	conn, _ := r.Connect("h1", nil, time.Now())
	r.Apply("h1", conn, &eitriv1.ActualStateReport{
		Vms:       []*eitriv1.ActualVM{{VmId: "a"}},
		Exposures: []*eitriv1.ExposureActual{{Id: "e"}},
	}, time.Now())
	d, ok := r.Disconnect("h1", conn)
	require.True(t, ok)
	assert.Equal(t, []string{"a"}, d.VMs)
	assert.Equal(t, []string{"e"}, d.Exposures)
	_, reporting := r.VM("h1", "a")
	assert.False(t, reporting)
}
