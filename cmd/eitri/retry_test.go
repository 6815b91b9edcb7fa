package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/a73x/eitri/agent/syncclient"
	"github.com/a73x/eitri/cmd/eitri/cli"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

// failingHost fails every create until a retry reaches it, then narrates
// the create again.
func failingHost() *scriptedHost {
	return &scriptedHost{row: func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		row := &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "stopped", Phase: "failed", LastError: "no space left on device", Retry: d.GetRetry()}
		if d.GetRetry() > 0 {
			row.Phase, row.LastError, row.StatusDetail = "creating", "", "downloading image"
			row.UnexpectedExits = 1
			row.LastExit = &eitriv1.GuestExit{Reason: "qemu exited (signal 9)", SerialTail: "Run /init as init process\nudhcpc: started"}
		}
		return row
	}}
}

func TestAFailedVMIsRetriedByNameFromTheCLI(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	eitri := e.eitri
	id := e.enroll("h1")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_ = syncclient.Run(ctx, syncclient.Config{Identity: id, Source: failingHost(), ReportEvery: 20 * time.Millisecond,
			Hello: func() *eitriv1.Hello { return &eitriv1.Hello{AgentVersion: "test"} }})
	}()
	require.Eventually(t, func() bool {
		out, err := eitri("host", "get", "h1", "-o", "json")
		var r eitriv1.GetHostResponse
		return err == nil && protojson.Unmarshal([]byte(out), &r) == nil && r.Host.Connected && r.Host.Capacity != nil
	}, 10*time.Second, 20*time.Millisecond, "the host is connected and has reported its capacity (a VM can be placed)")

	_, err := eitri("vm", "create", "web-1", "--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32))
	require.NoError(t, err)
	var out string
	require.Eventually(t, func() bool {
		out, err = eitri("vm", "ls")
		return err == nil && strings.Contains(out, "failed")
	}, 10*time.Second, 20*time.Millisecond)
	assert.Contains(t, out, "no space left on device")

	out, err = eitri("vm", "retry", "web-1")
	require.NoError(t, err, "a VM is named by its name")
	assert.Contains(t, out, "retrying")
	require.Eventually(t, func() bool {
		out, err = eitri("vm", "ls")
		return err == nil && strings.Contains(out, "creating")
	}, 10*time.Second, 20*time.Millisecond, "the host answers the retry")
	assert.Contains(t, out, "downloading image", "work under way shows its narration")

	vmID := strings.Fields(strings.Split(strings.TrimSpace(out), "\n")[1])[0]
	require.Eventually(t, func() bool {
		out, err = eitri("vm", "events", vmID)
		return err == nil && strings.Contains(out, "exited")
	}, 10*time.Second, 20*time.Millisecond)
	var exited []string
	lines := strings.Split(out, "\n")
	for i, l := range lines {
		if strings.Contains(l, "exited") {
			exited = lines[i : i+3]
		}
	}
	require.Len(t, exited, 3, out)
	assert.Contains(t, exited[0], "qemu exited (signal 9); serial console:")
	assert.Equal(t, "Run /init as init process", strings.TrimSpace(exited[1]), "console lines go under the event")
	assert.Equal(t, "udhcpc: started", strings.TrimSpace(exited[2]))
	assert.True(t, strings.HasPrefix(exited[1], " "), "indented, not a row of their own")

	_, err = eitri("vm", "retry", "web-1")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "failed precondition", "only a failed VM is retried")
	_, err = eitri("vm", "retry", "nope")
	require.Error(t, err)
	assert.Contains(t, err.Error(), `no VM has the id or name "nope"`)
	_, err = eitri("vm", "retry")
	var ue cli.UsageError
	assert.ErrorAs(t, err, &ue)
}
