package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/syncclient"
	"github.com/a73x/eitri/cmd/eitri/cli"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

// holder is an agent's node that holds one VM the control plane does not
// know of.
type holder struct{ held *eitriv1.QuarantinedVM }

func (h *holder) Apply(*eitriv1.DesiredStateSnapshot) bool { return true }
func (h *holder) Fill(rep *eitriv1.ActualStateReport) {
	rep.Capacity = &eitriv1.Capacity{Vcpus: 4, MemMb: 8192, DiskGb: 100}
	rep.Quarantined = []*eitriv1.QuarantinedVM{h.held}
}

func TestAnAdminSeesAndAdoptsAnOrphanedVMFromTheCLI(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	eitri, p := e.eitri, e.admin
	id := e.enroll("h1")
	held := &eitriv1.QuarantinedVM{VmId: "vm-lost", Name: "db", Power: "running", Reason: "no snapshot names it",
		SinceUnix: time.Now().Unix(), Held: &eitriv1.VMDesired{VmId: "vm-lost", Name: "db", ImageUrl: "http://images.test/g.raw",
			ImageSha256: strings.Repeat("ab", 32), Vcpus: 2, MemMb: 1024, DiskGb: 8, PowerState: "running", Owner: p.UserID, Version: 9}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_ = syncclient.Run(ctx, syncclient.Config{Identity: id, Source: &holder{held: held}, ReportEvery: 20 * time.Millisecond,
			Hello: func() *eitriv1.Hello { return &eitriv1.Hello{AgentVersion: "test"} }})
	}()

	var out string
	var err error
	require.Eventually(t, func() bool {
		out, err = eitri("vm", "orphans")
		return err == nil && strings.Contains(out, "vm-lost")
	}, 10*time.Second, 20*time.Millisecond)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 2, out)
	assert.Contains(t, lines[1], id.HostID)
	assert.Contains(t, lines[1], "admin ("+p.UserID+")", "the owner, by name")
	assert.Contains(t, lines[1], "2c/1024M/8G")
	assert.Contains(t, lines[1], "running (held running)")
	assert.Contains(t, lines[1], "no snapshot names it")

	out, err = eitri("host", "ls")
	require.NoError(t, err)
	assert.Contains(t, out, "ORPHANED VMS: 1 VM(s)")

	out, err = eitri("vm", "adopt", id.HostID, "vm-lost")
	require.NoError(t, err)
	assert.Contains(t, out, "vm-lost")
	out, err = eitri("vm", "get", "vm-lost")
	require.NoError(t, err)
	assert.Contains(t, out, "db")

	_, err = eitri("vm", "adopt", id.HostID)
	var ue cli.UsageError
	assert.ErrorAs(t, err, &ue)
}
