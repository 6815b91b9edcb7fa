package registry

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

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

func TestOnlyDurableChangesAreMarkedForTheStore(t *testing.T) {
	base := &eitriv1.ActualVM{VmId: "a", Phase: "creating", Power: "running", Ip: "10.0.0.2", StatusDetail: "downloading image 1%"}
	for _, tc := range []struct {
		name    string
		change  func(v *eitriv1.ActualVM)
		durable bool
	}{
		{"narration", func(v *eitriv1.ActualVM) { v.StatusDetail = "downloading image 2%" }, false},
		{"progress", func(v *eitriv1.ActualVM) { v.Progress = &eitriv1.Progress{Step: "download", DoneBytes: 7} }, false},
		{"power reading", func(v *eitriv1.ActualVM) { v.Power = "stopped" }, false},
		{"phase", func(v *eitriv1.ActualVM) { v.Phase = "ready" }, true},
		{"address", func(v *eitriv1.ActualVM) { v.Ip = "10.0.0.3" }, true},
		{"error", func(v *eitriv1.ActualVM) { v.LastError = "no disk" }, true},
		{"host key", func(v *eitriv1.ActualVM) { v.SshHostPubkey = "ssh-ed25519 AAAA" }, true},
		{"exit count", func(v *eitriv1.ActualVM) { v.UnexpectedExits = 1 }, true},
		{"last exit", func(v *eitriv1.ActualVM) { v.LastExit = &eitriv1.GuestExit{Reason: "crashed"} }, true},
		{"retry", func(v *eitriv1.ActualVM) { v.Retry = 2 }, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := New()
			conn, _ := r.Connect("h1", nil, time.Now())
			d, _ := r.Apply("h1", conn, &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{proto.CloneOf(base)}}, time.Now())
			assert.Equal(t, []string{"a"}, d.Durable, "a VM first reported is news for the store")
			next := proto.CloneOf(base)
			tc.change(next)
			d, _ = r.Apply("h1", conn, &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{next}}, time.Now())
			assert.Equal(t, []string{"a"}, d.VMs, "every change reaches the watchers")
			if tc.durable {
				assert.Equal(t, []string{"a"}, d.Durable)
			} else {
				assert.Empty(t, d.Durable, "commentary is never written down")
			}
		})
	}
}

func TestImageRowsThatMoveAreNewsAndAHostLeavingTakesThemAway(t *testing.T) {
	r := New()
	conn, _ := r.Connect("h1", nil, time.Now())
	pulling := &eitriv1.ImageHeld{Sha256: "ab", StatusDetail: "downloading image 1/3 GiB"}
	steps := []struct {
		name   string
		images []*eitriv1.ImageHeld
		news   bool
	}{
		{"none yet", nil, false},
		{"a pull starts", []*eitriv1.ImageHeld{pulling}, true},
		{"the same words again", []*eitriv1.ImageHeld{proto.CloneOf(pulling)}, false},
		{"it moves", []*eitriv1.ImageHeld{{Sha256: "ab", StatusDetail: "downloading image 2/3 GiB"}}, true},
		{"held", []*eitriv1.ImageHeld{{Sha256: "ab", Held: true}}, true},
	}
	for _, s := range steps {
		d, ok := r.Apply("h1", conn, &eitriv1.ActualStateReport{Images: s.images}, time.Now())
		require.True(t, ok)
		assert.Equal(t, s.news, d.Images, s.name)
	}
	d, ok := r.Disconnect("h1", conn)
	require.True(t, ok)
	assert.True(t, d.Images, "the images it held are no longer said to be held")
}

// A mirrored stream replaces the host's old one and brings its report in
// the same step: the diff names what left with the old stream and what the
// new report holds, and a reader never finds the host without a report.
func TestAStreamThatArrivesWithItsReportIsNeverSeenWithoutIt(t *testing.T) {
	r := New()
	now := time.Now()
	old, _ := r.Connect("h1", &eitriv1.Hello{HostId: "h1"}, now)
	r.Apply("h1", old, &eitriv1.ActualStateReport{
		Vms:       []*eitriv1.ActualVM{{VmId: "a", Phase: "ready"}, {VmId: "gone", Phase: "ready"}},
		Exposures: []*eitriv1.ExposureActual{{Id: "e-old", State: "active"}},
	}, now)

	stop := make(chan struct{})
	bare := make(chan int, 1)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				bare <- n
				return
			default:
			}
			if l, ok := r.Host("h1"); ok && l.Report == nil {
				n++
			}
		}
	}()
	var conn uint64
	var d Diff
	for range 2000 {
		conn, d = r.ConnectReporting("h1", &eitriv1.Hello{HostId: "h1"}, &eitriv1.ActualStateReport{
			Capacity:  &eitriv1.Capacity{},
			Vms:       []*eitriv1.ActualVM{{VmId: "a", Phase: "ready"}, {VmId: "new", Phase: "creating"}},
			Exposures: []*eitriv1.ExposureActual{{Id: "e-new", State: "active"}},
		}, now)
	}
	close(stop)
	assert.Zero(t, <-bare, "the host was seen connected with no report")

	assert.True(t, d.Host)
	assert.ElementsMatch(t, []string{"a", "new"}, d.VMs, "the last hand-over: what the old stream had and the new one reports")
	assert.ElementsMatch(t, []string{"a", "new"}, d.Durable)
	assert.ElementsMatch(t, []string{"e-new"}, d.Exposures)
	_, ok := r.Apply("h1", old, &eitriv1.ActualStateReport{}, now)
	assert.False(t, ok, "the replaced stream no longer applies")
	_, ok = r.Apply("h1", conn, &eitriv1.ActualStateReport{}, now)
	assert.True(t, ok)
}

func TestTheFirstHandOverNamesWhatTheOldStreamHeld(t *testing.T) {
	r := New()
	now := time.Now()
	old, _ := r.Connect("h1", nil, now)
	r.Apply("h1", old, &eitriv1.ActualStateReport{
		Vms:       []*eitriv1.ActualVM{{VmId: "gone", Phase: "ready"}},
		Exposures: []*eitriv1.ExposureActual{{Id: "e-old", State: "active"}},
		Images:    []*eitriv1.ImageHeld{{Sha256: "aa"}},
	}, now)
	_, d := r.ConnectReporting("h1", nil, &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{{VmId: "new"}}}, now)
	assert.ElementsMatch(t, []string{"gone", "new"}, d.VMs)
	assert.ElementsMatch(t, []string{"gone", "new"}, d.Durable)
	assert.ElementsMatch(t, []string{"e-old"}, d.Exposures)
	assert.True(t, d.Images, "the old stream's images went with it")
	assert.True(t, d.Host)
	row, reporting := r.VM("h1", "new")
	assert.True(t, reporting)
	assert.Equal(t, "new", row.GetVmId())
}
