package syncclient

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestOnlyTheBytesPortsCarriedDoNotMakeAReportNews(t *testing.T) {
	port := func(active, in int64) *eitriv1.ExposureActual {
		return &eitriv1.ExposureActual{Id: "e1", State: "active", Sessions: &eitriv1.ExposureSessions{Active: active,
			Carried: &eitriv1.ExposureBytes{In: in, Out: 2 * in}}}
	}
	report := func(es ...*eitriv1.ExposureActual) *eitriv1.ActualStateReport {
		return &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{{VmId: "v1", Phase: "ready"}}, Exposures: es}
	}
	for _, c := range []struct {
		name      string
		rep, last *eitriv1.ActualStateReport
		same      bool
	}{
		{"nothing moved", report(port(1, 10)), report(port(1, 10)), true},
		{"only bytes moved", report(port(1, 5000)), report(port(1, 10)), true},
		{"a connection opened", report(port(2, 5000)), report(port(1, 10)), false},
		{"a port came", report(port(1, 10), port(0, 0)), report(port(1, 10)), false},
		{"counters appeared", report(&eitriv1.ExposureActual{Id: "e1", State: "active"}), report(port(0, 0)), false},
		{"a VM moved", &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{{VmId: "v1", Phase: "stopped"}}, Exposures: []*eitriv1.ExposureActual{port(1, 10)}},
			report(port(1, 10)), false},
	} {
		rep, last := proto.CloneOf(c.rep), proto.CloneOf(c.last)
		assert.Equal(t, c.same, sameButBytes(rep, last), c.name)
		assert.True(t, proto.Equal(c.rep, rep), "%s: the report to send keeps its bytes", c.name)
		assert.True(t, proto.Equal(c.last, last), "%s: the last report is as it was", c.name)
	}
}
