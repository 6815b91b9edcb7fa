package fleet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/vmstate"
)

func TestLifecycleIsDerivedFromTheRowAndTheLiveReport(t *testing.T) {
	row := func(phase, power string) *eitriv1.ActualVM { return &eitriv1.ActualVM{Phase: phase, Power: power} }
	answering := func(r *eitriv1.ActualVM, retry uint64) *eitriv1.ActualVM { r.Retry = retry; return r }
	now := time.Now()
	type vm = store.VM
	cases := []struct {
		name      string
		vm        vm
		row       *eitriv1.ActualVM
		reporting bool
		want      string
	}{
		{"deleted wins over anything live", vm{Status: "ready", PowerState: "running", DeletedAt: &now}, row("ready", "running"), true, "deleting"},
		{"never reported", vm{Status: "pending", PowerState: "running"}, nil, false, "pending"},
		{"host connected, not picked up yet", vm{Status: "pending", PowerState: "running"}, nil, true, "pending"},
		{"host silent about a VM it ran", vm{Status: "ready", PowerState: "running"}, nil, false, "unknown"},
		{"creating", vm{Status: "pending", PowerState: "running"}, row("creating", "stopped"), true, "creating"},
		{"ready and running", vm{Status: "creating", PowerState: "running"}, row("ready", "running"), true, "ready"},
		{"stopped as asked", vm{Status: "ready", PowerState: "stopped"}, row("stopped", "stopped"), true, "stopped"},
		{"failed", vm{Status: "creating", PowerState: "running"}, row("failed", "stopped"), true, "failed"},

		// A request shows at once; the host's report confirms it later.
		{"started, host not acted yet", vm{Status: "stopped", PowerState: "running"}, row("stopped", "stopped"), true, "starting"},
		{"started, host booting", vm{Status: "stopped", PowerState: "running"}, row("starting", "stopped"), true, "starting"},
		{"started and up", vm{Status: "stopped", PowerState: "running"}, row("ready", "running"), true, "ready"},
		{"stopped, host not acted yet", vm{Status: "ready", PowerState: "stopped"}, row("ready", "running"), true, "stopping"},
		{"stopped, host shutting down", vm{Status: "ready", PowerState: "stopped"}, row("stopping", "running"), true, "stopping"},
		{"stopped, guest powered off", vm{Status: "ready", PowerState: "stopped"}, row("stopped", "stopped"), true, "stopped"},
		{"restored, host still deleting", vm{Status: "ready", PowerState: "running"}, row("deleting", "stopped"), true, "restoring"},
		{"restored, host starting it", vm{Status: "ready", PowerState: "running"}, row("starting", "stopped"), true, "starting"},
		{"guest exited, host restarting it", vm{Status: "ready", PowerState: "running"}, row("restarting", "stopped"), true, "restarting"},
		{"retried, host not seen it yet", vm{Status: "pending", PowerState: "running", Retry: 2}, answering(row("failed", "stopped"), 1), true, "retrying"},
		{"retried, failed again", vm{Status: "failed", PowerState: "running", Retry: 2}, answering(row("failed", "stopped"), 2), true, "failed"},
		{"retried, host disconnected", vm{Status: "pending", PowerState: "running", Retry: 2}, nil, false, "pending"},
		{"lost wins over everything", vm{Status: vmstate.LifecycleLost, PowerState: "running"}, nil, false, "lost"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.want, Lifecycle(c.vm, c.row, c.reporting))
		})
	}
}
