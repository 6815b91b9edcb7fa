package mcp_test

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/fleet"
	eitrimcp "github.com/a73x/eitri/server/mcp"
)

// host enrolls a host and connects it in process, through the same fleet
// calls the agent stream handler makes, with room for small VMs.
type host struct {
	t    *testing.T
	sess *fleet.Session
}

func connectHost(t *testing.T, e env) *host {
	t.Helper()
	ctx := context.Background()
	jt, err := e.fleet.CreateJoinToken(e.as(t, e.token), time.Hour)
	require.NoError(t, err)
	er, err := e.fleet.Enroll(ctx, &eitriv1.EnrollRequest{JoinToken: jt.GetToken(), Hostname: "h1", AgentVersion: "test"})
	require.NoError(t, err)
	s, err := e.fleet.OpenSession(ctx, er.GetHostId(), &eitriv1.Hello{HostId: er.GetHostId(), AgentVersion: "test", Hostname: "h1"}, "192.0.2.1:1")
	require.NoError(t, err)
	t.Cleanup(s.Close)
	h := &host{t: t, sess: s}
	h.report()
	return h
}

func (h *host) report(vms ...*eitriv1.ActualVM) {
	h.sess.Apply(context.Background(), &eitriv1.ActualStateReport{
		Vms:      vms,
		Capacity: &eitriv1.Capacity{Vcpus: 8, MemMb: 16384, DiskGb: 200},
	})
}

func validCreate() map[string]any {
	return map[string]any{
		"name": "web-1", "image_url": "http://127.0.0.1/img.raw",
		"image_sha256": strings.Repeat("a", 64), "vcpus": 1, "mem_mb": 512, "disk_gb": 4,
		"wait_seconds": 2,
	}
}

// notice is one progress notification as the client received it.
type notice struct {
	msg          string
	value, total float64
}

// createInBackground calls vm_create asking for progress, and returns the
// progress notifications as they come and the result when it does.
func createInBackground(t *testing.T, cs *mcp.ClientSession, progress <-chan *mcp.ProgressNotificationParams, args map[string]any) (<-chan notice, <-chan *mcp.CallToolResult) {
	t.Helper()
	params := &mcp.CallToolParams{Name: "vm_create", Arguments: args}
	params.SetProgressToken("create-1")
	notices := make(chan notice, 16)
	done := make(chan *mcp.CallToolResult, 1)
	go func() {
		for p := range progress {
			if p.ProgressToken == "create-1" {
				notices <- notice{msg: p.Message, value: p.Progress, total: p.Total}
			}
		}
	}()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		res, err := cs.CallTool(ctx, params)
		if err != nil {
			res = &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: "protocol error: " + err.Error()}}}
		}
		done <- res
	}()
	return notices, done
}

func createWaiting(t *testing.T, cs *mcp.ClientSession, progress <-chan *mcp.ProgressNotificationParams, wait int) (<-chan notice, <-chan *mcp.CallToolResult) {
	t.Helper()
	args := validCreate()
	args["wait_seconds"] = wait
	return createInBackground(t, cs, progress, args)
}

func next(t *testing.T, notices <-chan notice) notice {
	t.Helper()
	select {
	case n := <-notices:
		return n
	case <-time.After(10 * time.Second):
		t.Fatal("no progress notification")
		return notice{}
	}
}

func result(t *testing.T, done <-chan *mcp.CallToolResult) *mcp.CallToolResult {
	t.Helper()
	select {
	case res := <-done:
		return res
	case <-time.After(15 * time.Second):
		t.Fatal("vm_create did not return")
		return nil
	}
}

func onlyVMID(t *testing.T, e env) string {
	t.Helper()
	vms, err := e.fleet.ListVMs(e.as(t, e.token))
	require.NoError(t, err)
	require.Len(t, vms, 1)
	return vms[0].GetId()
}

func TestVMCreateNarratesUntilReady(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connect(t, e, progress)
	notices, done := createWaiting(t, cs, progress, 60)

	// Before its host lists it, there is nothing to narrate but that.
	assert.Equal(t, notice{msg: "creating vm web-1: not listed yet"}, next(t, notices))
	id := onlyVMID(t, e)

	// The host's sentence is the message; its measure is the numbers.
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "creating", Power: "stopped",
		StatusDetail: "downloading image 1.2/3.7 GiB",
		Progress:     &eitriv1.Progress{Step: "download", DoneBytes: 1_200_000_000, TotalBytes: proto.Uint64(3_700_000_000)}})
	assert.Equal(t, notice{msg: "creating vm web-1: creating, downloading image 1.2/3.7 GiB", value: 1.2e9, total: 3.7e9}, next(t, notices))

	// Mid-download, vm_get shows the same measure; the VM list too.
	got := ok[eitrimcp.VM](t, cs, "vm_get", map[string]any{"id": id})
	require.NotNil(t, got.Progress)
	assert.Equal(t, eitrimcp.Progress{Step: "download", DoneBytes: 1_200_000_000, TotalBytes: ptr(uint64(3_700_000_000))}, *got.Progress)
	list := ok[eitrimcp.VMListOut](t, cs, "vm_list", map[string]any{})
	require.Len(t, list.VMs, 1)
	assert.Equal(t, got.Progress, list.VMs[0].Progress)

	// A server that sends no length: bytes, and no total.
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "creating", Power: "stopped",
		StatusDetail: "downloading image 2.0 GiB",
		Progress:     &eitriv1.Progress{Step: "download", DoneBytes: 2_000_000_000}})
	assert.Equal(t, notice{msg: "creating vm web-1: creating, downloading image 2.0 GiB", value: 2e9}, next(t, notices))

	// A step with no measure keeps the count where it was, without a total.
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "creating", Power: "stopped", StatusDetail: "booting"})
	assert.Equal(t, notice{msg: "creating vm web-1: creating, booting", value: 2e9}, next(t, notices))
	// Ready without an address is not done yet: nobody can reach it.
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "ready", Power: "running"})
	assert.Equal(t, "creating vm web-1: ready", next(t, notices).msg)
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "ready", Power: "running", Ip: "10.77.0.5"})

	res := result(t, done)
	require.False(t, res.IsError, text(res))
	out := structured[eitrimcp.VMCreateOut](t, res)
	assert.Equal(t, "10.77.0.5", out.VM.AssignedIP)
	assert.Empty(t, out.Note)
	assert.Equal(t, "ready", out.VM.Lifecycle)
	assert.Equal(t, id, out.VM.ID)
	// A settled VM measures nothing: null, not 0 of 0.
	raw, err := json.Marshal(res.StructuredContent)
	require.NoError(t, err)
	assert.Contains(t, string(raw), `"progress":null`)
}

// A host that never reports on the VM: the narration is the one line, and
// the note at the deadline says the same.
func TestVMCreateNotListedYet(t *testing.T) {
	e := start(t)
	connectHost(t, e)
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connect(t, e, progress)
	notices, done := createWaiting(t, cs, progress, 1)

	assert.Equal(t, notice{msg: "creating vm web-1: not listed yet"}, next(t, notices))
	res := result(t, done)
	require.False(t, res.IsError, text(res))
	out := structured[eitrimcp.VMCreateOut](t, res)
	assert.Equal(t, "vm web-1 is still being created (not listed yet) after 1s; this is not a failure: check it with vm_get", out.Note)
	assert.Equal(t, "pending", out.VM.Lifecycle)
	assert.Nil(t, out.VM.Progress)
	select {
	case n := <-notices:
		t.Fatalf("a host that says nothing got narrated: %+v", n)
	default:
	}
}

// How a waiting vm_create ends follows what its host reports once it has
// listed the VM: each step is a report and, when set, the progress message
// it must bring.
func TestVMCreateEndsAsItsHostReports(t *testing.T) {
	type step struct {
		report *eitriv1.ActualVM
		says   string
	}
	for _, c := range []struct {
		name  string
		power string // asked for; "" is the default, running
		wait  int
		steps []step
		check func(t *testing.T, res *mcp.CallToolResult, id string)
	}{{
		// Created and off is what was asked for: no address will come.
		name: "created stopped", power: "stopped", wait: 60,
		steps: []step{
			{&eitriv1.ActualVM{Phase: "creating", Power: "stopped", StatusDetail: "preparing root disk"}, "creating vm web-1: creating, preparing root disk"},
			{report: &eitriv1.ActualVM{Phase: "stopped", Power: "stopped"}},
		},
		check: func(t *testing.T, res *mcp.CallToolResult, _ string) {
			require.False(t, res.IsError, text(res))
			out := structured[eitrimcp.VMCreateOut](t, res)
			assert.Equal(t, "stopped", out.VM.Lifecycle)
			assert.Equal(t, "stopped", out.VM.PowerState)
			assert.Empty(t, out.Note)
		},
	}, {
		name: "failed", wait: 60,
		steps: []step{{report: &eitriv1.ActualVM{Phase: "failed", Power: "stopped", LastError: "image sha256 mismatch"}}},
		check: func(t *testing.T, res *mcp.CallToolResult, _ string) {
			assert.True(t, res.IsError)
			assert.Contains(t, text(res), "failed: image sha256 mismatch")
		},
	}, {
		name: "still creating at the deadline", wait: 1,
		steps: []step{{report: &eitriv1.ActualVM{Phase: "creating", Power: "stopped", StatusDetail: "preparing root disk"}}},
		check: func(t *testing.T, res *mcp.CallToolResult, id string) {
			require.False(t, res.IsError, text(res))
			out := structured[eitrimcp.VMCreateOut](t, res)
			assert.Contains(t, out.Note, "still being created")
			assert.Contains(t, out.Note, "not a failure")
			assert.Equal(t, id, out.VM.ID)
		},
	}} {
		t.Run(c.name, func(t *testing.T) {
			e := start(t)
			h := connectHost(t, e)
			progress := make(chan *mcp.ProgressNotificationParams, 16)
			cs := connect(t, e, progress)
			args := validCreate()
			args["wait_seconds"] = c.wait
			if c.power != "" {
				args["power_state"] = c.power
			}
			notices, done := createInBackground(t, cs, progress, args)

			next(t, notices)
			id := onlyVMID(t, e)
			for _, s := range c.steps {
				s.report.VmId = id
				h.report(s.report)
				if s.says != "" {
					assert.Equal(t, s.says, next(t, notices).msg)
				}
			}
			c.check(t, result(t, done), id)
		})
	}
}

// The wait is a watch stream and counts against the streams quota like
// WatchVMs; the create itself is a unary call the API would allow, so it
// happens and the VM comes back unfollowed.
func TestVMCreateWithoutStreamsLeftIsNotFollowed(t *testing.T) {
	e := start(t)
	connectHost(t, e)
	bob := e.userToken(t, "bob")
	e.setStreams(t, "bob", 0)
	cs := connectAs(t, e, bob, nil)

	out := ok[eitrimcp.VMCreateOut](t, cs, "vm_create", validCreate())
	assert.NotEmpty(t, out.VM.ID)
	assert.Contains(t, out.Note, "was created but is not being followed")
	assert.Contains(t, out.Note, "quota: streams")
}

func TestVMRetryTriesAFailedVMAgain(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connect(t, e, progress)
	notices, done := createWaiting(t, cs, progress, 60)
	next(t, notices)
	id := onlyVMID(t, e)
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "failed", Power: "stopped", LastError: "no space left on device"})
	require.True(t, result(t, done).IsError)

	vm := ok[eitrimcp.VM](t, cs, "vm_retry", map[string]any{"id": id})
	assert.Equal(t, "retrying", vm.Lifecycle)

	h.report(&eitriv1.ActualVM{VmId: id, Phase: "creating", Power: "stopped", StatusDetail: "downloading image", Retry: 1})
	msg := refused(t, cs, "vm_retry", map[string]any{"id": id})
	assert.Contains(t, msg, "failed_precondition: ")
	assert.Contains(t, msg, "only a failed VM can be retried")
}

func ptr[T any](v T) *T { return &v }

// vm_create by a catalogue name: image_list shows the name, the create
// takes the image's current digest, and the VM says what it was made from.
func TestVMCreateByImageName(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	sha := strings.Repeat("c", 64)
	_, err := e.fleet.AddImage(e.as(t, e.token), &eitriv1.AddImageRequest{Name: "debian-12", Url: "http://images.test/d.qcow2", Sha256: sha,
		Properties: &eitriv1.ImageProperties{Description: "Debian 12", MinMemMb: 1024}})
	require.NoError(t, err)
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connect(t, e, progress)

	imgs := ok[eitrimcp.ImageListOut](t, cs, "image_list", map[string]any{})
	require.Len(t, imgs.Images, 1)
	assert.Equal(t, eitrimcp.Image{Name: "debian-12", Description: "Debian 12", MinMemMB: 1024, Version: 1, SHA256: sha}, imgs.Images[0])

	args := map[string]any{"name": "web-1", "image": "debian-12", "vcpus": 1, "mem_mb": 512, "disk_gb": 4, "wait_seconds": 2}
	res := call(t, cs, "vm_create", args)
	assert.True(t, res.IsError)
	assert.Contains(t, text(res), "mem_mb: image debian-12 needs at least 1024 MiB", "the refusal names the field")

	args["mem_mb"] = 1024
	notices, done := createInBackground(t, cs, progress, args)
	next(t, notices)
	id := onlyVMID(t, e)
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "ready", Power: "running", Ip: "10.77.0.5"})
	res = result(t, done)
	require.False(t, res.IsError, text(res))
	out := structured[eitrimcp.VMCreateOut](t, res)
	assert.Equal(t, "ready", out.VM.Lifecycle)
	assert.Equal(t, "debian-12", out.VM.ImageName)
	assert.Equal(t, int64(1), out.VM.ImageVersion)
	assert.Equal(t, sha, out.VM.ImageSHA256)
}
