package mcp_test

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/fleet"
	eitrimcp "github.com/a73x/eitri/server/mcp"
	"github.com/a73x/eitri/wire/bounds"
)

// schemaProp is the part of a property's JSON Schema the tests read.
type schemaProp struct {
	Type      any      `json:"type"`
	Minimum   *float64 `json:"minimum"`
	Maximum   *float64 `json:"maximum"`
	MinLength *int     `json:"minLength"`
	MaxLength *int     `json:"maxLength"`
	Enum      []string `json:"enum"`
	Examples  []string `json:"examples"`
}

type inputSchema struct {
	Properties map[string]schemaProp `json:"properties"`
	Required   []string              `json:"required"`
}

// schemas lists the tools as a client sees them: description and input
// schema by name.
func schemas(t *testing.T, e env) (map[string]string, map[string]inputSchema) {
	t.Helper()
	cs := connect(t, e, nil)
	res, err := cs.ListTools(context.Background(), nil)
	require.NoError(t, err)
	descs, ins := map[string]string{}, map[string]inputSchema{}
	for _, tl := range res.Tools {
		raw, err := json.Marshal(tl.InputSchema)
		require.NoError(t, err)
		var s inputSchema
		require.NoError(t, json.Unmarshal(raw, &s), string(raw))
		descs[tl.Name], ins[tl.Name] = tl.Description, s
	}
	return descs, ins
}

func TestListTools(t *testing.T) {
	descs, ins := schemas(t, start(t))
	var names []string
	for name, d := range descs {
		names = append(names, name)
		assert.NotEmpty(t, d, name)
	}
	assert.ElementsMatch(t, []string{
		"vm_list", "vm_get", "vm_create", "vm_start", "vm_stop", "vm_delete", "vm_restore", "vm_retry", "vm_events",
		"exposure_create", "exposure_list", "exposure_delete", "image_list", "vm_usage",
	}, names)
	assert.ElementsMatch(t, []string{"name", "vcpus", "mem_mb", "disk_gb"}, ins["vm_create"].Required, "an image by name, or by URL and digest")
	for _, p := range []string{"image", "image_url", "image_sha256", "ssh_authorized_key", "host_id", "power_state", "wait_seconds"} {
		assert.Contains(t, ins["vm_create"].Properties, p, "vm_create takes every field CreateVM does")
	}
	assert.ElementsMatch(t, []string{"vm_id", "guest_port"}, ins["exposure_create"].Required)
	for _, p := range []string{"host_port", "protocol", "scope", "max_sessions"} {
		assert.Contains(t, ins["exposure_create"].Properties, p, "exposure_create takes every field CreateExposure does")
	}
}

// The schema publishes the bounds the API enforces, and ids the way the
// fleet mints them.
func TestInputSchemaBounds(t *testing.T) {
	descs, ins := schemas(t, start(t))
	f := func(v float64) *float64 { return &v }
	cases := []struct {
		tool, prop string
		min, max   *float64
	}{
		{"vm_create", "vcpus", f(bounds.MinVCPUs), f(bounds.MaxVCPUs)},
		{"vm_create", "mem_mb", f(bounds.MinMemMB), f(bounds.MaxMemMB)},
		{"vm_create", "disk_gb", f(bounds.MinDiskGB), f(bounds.MaxDiskGB)},
		{"vm_create", "wait_seconds", f(0), nil},
		{"exposure_create", "guest_port", f(1), f(bounds.MaxPort)},
		{"exposure_create", "host_port", f(0), f(bounds.MaxPort)},
		{"exposure_create", "max_sessions", f(0), f(4294967295)},
	}
	for _, tc := range cases {
		t.Run(tc.tool+"."+tc.prop, func(t *testing.T) {
			p, ok := ins[tc.tool].Properties[tc.prop]
			require.True(t, ok)
			assert.Equal(t, "integer", p.Type)
			assert.Equal(t, tc.min, p.Minimum)
			assert.Equal(t, tc.max, p.Maximum)
		})
	}
	assert.Equal(t, []string{"running", "stopped"}, ins["vm_create"].Properties["power_state"].Enum)
	assert.Equal(t, []string{"tcp", "udp"}, ins["exposure_create"].Properties["protocol"].Enum)
	assert.Equal(t, []string{"lan", "local"}, ins["exposure_create"].Properties["scope"].Enum)

	idShape := map[string]*regexp.Regexp{
		"vm": regexp.MustCompile(`^vm-[a-z2-7]{16}$`), "x": regexp.MustCompile(`^x-[a-z2-7]{16}$`),
	}
	ids := []struct{ tool, prop, kind string }{
		{"vm_get", "id", "vm"}, {"vm_start", "id", "vm"}, {"vm_stop", "id", "vm"}, {"vm_delete", "id", "vm"},
		{"vm_restore", "id", "vm"}, {"vm_retry", "id", "vm"}, {"vm_events", "vm_id", "vm"},
		{"exposure_create", "vm_id", "vm"}, {"exposure_list", "vm_id", "vm"}, {"exposure_delete", "id", "x"},
	}
	for _, id := range ids {
		p := ins[id.tool].Properties[id.prop]
		require.Len(t, p.Examples, 1, "%s.%s", id.tool, id.prop)
		assert.Regexp(t, idShape[id.kind], p.Examples[0], "%s.%s", id.tool, id.prop)
		require.NotNil(t, p.MaxLength)
		assert.Equal(t, bounds.MaxIDLen, *p.MaxLength)
	}
	// No description tells a model ids look like vm_...
	raw, err := json.Marshal([]any{descs, ins})
	require.NoError(t, err)
	assert.NotContains(t, string(raw), "vm_...")
	assert.NotRegexp(t, `e\.g\. (vm|x|h)_`, string(raw))
}

// The schema and the fleet read the same bounds (wire/bounds), but each
// says for itself which side of an edge is allowed: just inside each bound
// the schema lets a create through to the fleet, which accepts it too (and
// then finds no host); just outside, both refuse it, naming the field, and
// nothing is created.
func TestSchemaAndAPIAgreeOnEachEdge(t *testing.T) {
	e := start(t)
	cs := connect(t, e, nil)
	cases := []struct {
		field     string
		in, out   int64
		setOnWire func(*eitriv1.CreateVMRequest, int64)
	}{
		{"vcpus", bounds.MinVCPUs, bounds.MinVCPUs - 1, func(r *eitriv1.CreateVMRequest, v int64) { r.Vcpus = int32(v) }},
		{"vcpus", bounds.MaxVCPUs, bounds.MaxVCPUs + 1, func(r *eitriv1.CreateVMRequest, v int64) { r.Vcpus = int32(v) }},
		{"mem_mb", bounds.MinMemMB, bounds.MinMemMB - 1, func(r *eitriv1.CreateVMRequest, v int64) { r.MemMb = v }},
		{"mem_mb", bounds.MaxMemMB, bounds.MaxMemMB + 1, func(r *eitriv1.CreateVMRequest, v int64) { r.MemMb = v }},
		{"disk_gb", bounds.MinDiskGB, bounds.MinDiskGB - 1, func(r *eitriv1.CreateVMRequest, v int64) { r.DiskGb = v }},
		{"disk_gb", bounds.MaxDiskGB, bounds.MaxDiskGB + 1, func(r *eitriv1.CreateVMRequest, v int64) { r.DiskGb = v }},
	}
	for _, tc := range cases {
		t.Run(tc.field, func(t *testing.T) {
			args := validCreate()
			args[tc.field] = tc.in
			msg := refused(t, cs, "vm_create", args)
			// Past validation: the quota or placement answers.
			assert.Regexp(t, `^(resource_exhausted: quota|failed_precondition: no connected host has room)`, msg)

			args[tc.field] = tc.out
			msg = refused(t, cs, "vm_create", args)
			assert.Contains(t, msg, tc.field, "the refusal names the field")

			r := &eitriv1.CreateVMRequest{Name: "web-1", ImageUrl: "http://127.0.0.1/img.raw",
				ImageSha256: strings.Repeat("a", 64), Vcpus: 1, MemMb: 512, DiskGb: 4}
			tc.setOnWire(r, tc.out)
			_, err := e.fleet.CreateVM(e.as(t, e.token), r)
			require.Error(t, err)
			assert.Equal(t, fleet.Invalid, fleet.KindOf(err), "the API refuses it too")
			assert.Contains(t, err.Error(), tc.field+": ")
		})
	}
	assert.Empty(t, ok[eitrimcp.VMListOut](t, cs, "vm_list", map[string]any{}).VMs)
}

func TestVMListEmpty(t *testing.T) {
	cs := connect(t, start(t), nil)
	res := call(t, cs, "vm_list", map[string]any{})
	require.False(t, res.IsError, text(res))
	raw, err := json.Marshal(res.StructuredContent)
	require.NoError(t, err)
	assert.JSONEq(t, `{"vms":[]}`, string(raw))
}

// Bad input is refused with the API's code word and a message naming the
// field, and changes nothing.
func TestToolErrors(t *testing.T) {
	e := start(t)
	cs := connect(t, e, nil)
	with := func(k string, v any) map[string]any {
		m := validCreate()
		m[k] = v
		return m
	}
	without := func(k string) map[string]any {
		m := validCreate()
		delete(m, k)
		return m
	}
	long := strings.Repeat("a", 65)
	cases := []struct {
		name, tool string
		args       any
		want       []string
	}{
		{"bad name", "vm_create", with("name", "Not_A_Label"), []string{"invalid_argument: name: "}},
		{"bad sha", "vm_create", with("image_sha256", strings.Repeat("A", 64)), []string{"invalid_argument: image_sha256: "}},
		{"bad url", "vm_create", with("image_url", "ftp://x/y"), []string{"invalid_argument: image_url: "}},
		{"short sha", "vm_create", with("image_sha256", "abc"), []string{"invalid_argument: image_sha256: must be 64 lowercase hex characters"}},
		{"missing vcpus", "vm_create", without("vcpus"), []string{"invalid_argument: vcpus: required"}},
		{"zero vcpus", "vm_create", with("vcpus", 0), []string{"invalid_argument: vcpus: must be between 1 and 256, got 0"}},
		{"half a vcpu", "vm_create", with("vcpus", 1.5), []string{"invalid_argument: vcpus: must be an integer, got 1.5"}},
		{"small memory", "vm_create", with("mem_mb", 32), []string{"invalid_argument: mem_mb: must be between 64 and 4194304, got 32"}},
		{"no disk", "vm_create", with("disk_gb", 0), []string{"invalid_argument: disk_gb: must be between 1 and 65536, got 0"}},
		{"vcpus as text", "vm_create", with("vcpus", "two"), []string{"invalid_argument: vcpus: must be an integer, got a string"}},
		{"bad power", "vm_create", with("power_state", "paused"), []string{`invalid_argument: power_state: must be "running" or "stopped", got "paused"`}},
		{"negative wait", "vm_create", with("wait_seconds", -1), []string{"invalid_argument: wait_seconds: must be at least 0, got -1"}},
		{"unknown field", "vm_create", with("colour", "blue"), []string{"invalid_argument: colour: unknown field (vm_create takes name, "}},
		{"long key", "vm_create", with("ssh_authorized_key", strings.Repeat("k", 8193)), []string{"invalid_argument: ssh_authorized_key: at most 8192 bytes, got 8193"}},
		{"null name", "vm_create", with("name", nil), []string{"invalid_argument: name: must be a string, got null"}},
		{"unknown host", "vm_create", with("host_id", "h-nope"), []string{"invalid_argument: host_id: "}},
		// No host is connected, so placement refuses before anything is stored.
		{"no host", "vm_create", validCreate(), []string{"no connected host has room for 1 vCPU, 512 MiB memory and 4 GiB disk"}},
		{"unknown vm", "vm_get", map[string]any{"id": "vm-nope"}, []string{"not_found: vm vm-nope not found"}},
		{"empty id", "vm_get", map[string]any{"id": ""}, []string{"invalid_argument: id: required"}},
		{"missing id", "vm_get", map[string]any{}, []string{"invalid_argument: id: required"}},
		{"long id", "vm_get", map[string]any{"id": long}, []string{"invalid_argument: id: at most 64 bytes, got 65"}},
		{"list takes nothing", "vm_list", map[string]any{"all": true}, []string{"invalid_argument: all: unknown field (vm_list takes no arguments)"}},
		{"start unknown", "vm_start", map[string]any{"id": "vm-nope"}, []string{"not_found: "}},
		{"stop unknown", "vm_stop", map[string]any{"id": "vm-nope"}, []string{"not_found: "}},
		{"delete unknown", "vm_delete", map[string]any{"id": "vm-nope"}, []string{"not_found: "}},
		{"restore unknown", "vm_restore", map[string]any{"id": "vm-nope"}, []string{"not_found: "}},
		{"retry unknown", "vm_retry", map[string]any{"id": "vm-nope"}, []string{"not_found: "}},
		{"events unknown", "vm_events", map[string]any{"vm_id": "vm-nope"}, []string{"not_found: "}},
		{"events empty", "vm_events", map[string]any{"vm_id": ""}, []string{"invalid_argument: vm_id: required"}},
		{"expose unknown vm", "exposure_create", map[string]any{"vm_id": "vm-nope", "guest_port": 80}, []string{"not_found: "}},
		{"expose no port", "exposure_create", map[string]any{"vm_id": "vm-nope"}, []string{"invalid_argument: guest_port: required"}},
		{"expose port 0", "exposure_create", map[string]any{"vm_id": "vm-nope", "guest_port": 0}, []string{"invalid_argument: guest_port: must be between 1 and 65535, got 0"}},
		{"expose port too big", "exposure_create", map[string]any{"vm_id": "vm-nope", "guest_port": 65536}, []string{"invalid_argument: guest_port: must be between 1 and 65535, got 65536"}},
		{"expose host port too big", "exposure_create", map[string]any{"vm_id": "vm-nope", "guest_port": 80, "host_port": 70000}, []string{"invalid_argument: host_port: must be between 0 and 65535, got 70000"}},
		{"expose sctp", "exposure_create", map[string]any{"vm_id": "vm-nope", "guest_port": 80, "protocol": "sctp"}, []string{`invalid_argument: protocol: must be "tcp" or "udp", got "sctp"`}},
		{"expose wide", "exposure_create", map[string]any{"vm_id": "vm-nope", "guest_port": 80, "scope": "world"}, []string{`invalid_argument: scope: must be "lan" or "local", got "world"`}},
		{"list unknown vm", "exposure_list", map[string]any{"vm_id": "vm-nope"}, []string{"not_found: "}},
		{"unexpose unknown", "exposure_delete", map[string]any{"id": "x-nope"}, []string{"not_found: exposure x-nope not found"}},
		{"unexpose empty", "exposure_delete", map[string]any{"id": ""}, []string{"invalid_argument: id: required"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			msg := refused(t, cs, tc.tool, tc.args)
			for _, w := range tc.want {
				assert.Contains(t, msg, w)
			}
		})
	}
	// Nothing was created along the way.
	assert.Empty(t, ok[eitrimcp.VMListOut](t, cs, "vm_list", map[string]any{}).VMs)
	assert.Empty(t, ok[eitrimcp.ExposureListOut](t, cs, "exposure_list", map[string]any{}).Exposures)
}

// adminVM creates a VM for the admin through the fleet, as the API would.
func adminVM(t *testing.T, e env, name string) *eitriv1.VM {
	t.Helper()
	vm, err := e.fleet.CreateVM(e.as(t, e.token), &eitriv1.CreateVMRequest{
		Name: name, ImageUrl: "http://127.0.0.1/img.raw", ImageSha256: strings.Repeat("a", 64),
		Vcpus: 1, MemMb: 512, DiskGb: 4,
	})
	require.NoError(t, err)
	return vm
}

// Another user's VM and exposure are not found through every tool, and
// no attempt changes them.
func TestOtherUsersVMIsNotFound(t *testing.T) {
	e := start(t)
	connectHost(t, e)
	vm := adminVM(t, e, "web-1")
	admin := connect(t, e, nil)
	x := ok[eitrimcp.ExposureOut](t, admin, "exposure_create", map[string]any{"vm_id": vm.GetId(), "guest_port": 80}).Exposure
	eventsBefore := ok[eitrimcp.VMEventsOut](t, admin, "vm_events", map[string]any{"vm_id": vm.GetId()}).Events

	bob := connectAs(t, e, e.userToken(t, "bob"), nil)
	id := map[string]any{"id": vm.GetId()}
	cases := []struct {
		tool string
		args any
		want string
	}{
		{"vm_get", id, "not_found: vm " + vm.GetId() + " not found"},
		{"vm_start", id, "not_found: "},
		{"vm_stop", id, "not_found: "},
		{"vm_delete", id, "not_found: "},
		{"vm_restore", id, "not_found: "},
		{"vm_retry", id, "not_found: "},
		{"vm_events", map[string]any{"vm_id": vm.GetId()}, "not_found: "},
		{"exposure_create", map[string]any{"vm_id": vm.GetId(), "guest_port": 22}, "not_found: "},
		{"exposure_list", map[string]any{"vm_id": vm.GetId()}, "not_found: "},
		{"exposure_delete", map[string]any{"id": x.ID}, "not_found: exposure " + x.ID + " not found"},
	}
	for _, tc := range cases {
		t.Run(tc.tool, func(t *testing.T) {
			assert.Contains(t, refused(t, bob, tc.tool, tc.args), tc.want)
		})
	}
	assert.Empty(t, ok[eitrimcp.VMListOut](t, bob, "vm_list", map[string]any{}).VMs)
	assert.Empty(t, ok[eitrimcp.ExposureListOut](t, bob, "exposure_list", map[string]any{}).Exposures)
	// Names are per user: bob may have a web-1 of his own.
	args := validCreate()
	args["wait_seconds"] = 1
	mine := ok[eitrimcp.VMCreateOut](t, bob, "vm_create", args).VM
	assert.NotEqual(t, vm.GetId(), mine.ID)

	// The admin's VM and exposure are as they were.
	after := ok[eitrimcp.VM](t, admin, "vm_get", map[string]any{"id": vm.GetId()})
	assert.Equal(t, "running", after.PowerState)
	assert.False(t, after.Deleted)
	exps := ok[eitrimcp.ExposureListOut](t, admin, "exposure_list", map[string]any{"vm_id": vm.GetId()}).Exposures
	require.Len(t, exps, 1)
	assert.Equal(t, x.ID, exps[0].ID)
	assert.Equal(t, eventsBefore, ok[eitrimcp.VMEventsOut](t, admin, "vm_events", map[string]any{"vm_id": vm.GetId()}).Events)
}

func TestVMDeleteRestoreAndEvents(t *testing.T) {
	e := start(t)
	connectHost(t, e)
	vm := adminVM(t, e, "web-1")
	cs := connect(t, e, nil)
	id := map[string]any{"id": vm.GetId()}

	assert.Contains(t, refused(t, cs, "vm_restore", id), "failed_precondition: vm "+vm.GetId()+" is not deleted")

	stopped := ok[eitrimcp.VM](t, cs, "vm_stop", id)
	assert.Equal(t, "stopped", stopped.PowerState)
	deleted := ok[eitrimcp.VM](t, cs, "vm_delete", id)
	assert.True(t, deleted.Deleted)
	assert.NotEmpty(t, deleted.DestroyAt)
	assert.NotEmpty(t, deleted.RestorableUntil)
	assert.Contains(t, refused(t, cs, "vm_start", id), "restore it first")

	restored := ok[eitrimcp.VM](t, cs, "vm_restore", id)
	assert.False(t, restored.Deleted)
	assert.Empty(t, restored.DestroyAt)
	assert.Empty(t, restored.RestorableUntil)
	assert.Equal(t, "stopped", restored.PowerState, "a restore brings back the VM as it was")

	evs := ok[eitrimcp.VMEventsOut](t, cs, "vm_events", map[string]any{"vm_id": vm.GetId()}).Events
	var kinds []string
	for _, ev := range evs {
		kinds = append(kinds, ev.Kind)
		assert.NotEmpty(t, ev.At)
		assert.NotEmpty(t, ev.Message)
	}
	assert.Equal(t, []string{"created", "power", "deleted", "restored"}, kinds)
}

// A restore has to fit the owner's quota again, as through the API.
func TestVMRestoreRespectsQuota(t *testing.T) {
	e := start(t)
	connectHost(t, e)
	bobToken := e.userToken(t, "bob")
	bob := connectAs(t, e, bobToken, nil)
	_, err := e.fleet.SetQuota(e.as(t, e.token), &eitriv1.SetQuotaRequest{
		UserName: "bob", Limits: &eitriv1.QuotaLimits{Vms: ptr(int64(1))},
	})
	require.NoError(t, err)
	args := validCreate()
	args["wait_seconds"] = 1
	first := ok[eitrimcp.VMCreateOut](t, bob, "vm_create", args).VM
	args["name"] = "web-2"
	assert.Contains(t, refused(t, bob, "vm_create", args), "resource_exhausted: quota: vms")

	ok[eitrimcp.VM](t, bob, "vm_delete", map[string]any{"id": first.ID})
	second := ok[eitrimcp.VMCreateOut](t, bob, "vm_create", args).VM
	assert.Contains(t, refused(t, bob, "vm_restore", map[string]any{"id": first.ID}), "resource_exhausted: quota: vms")
	ok[eitrimcp.VM](t, bob, "vm_delete", map[string]any{"id": second.ID})
	assert.False(t, ok[eitrimcp.VM](t, bob, "vm_restore", map[string]any{"id": first.ID}).Deleted)
}

func TestExposures(t *testing.T) {
	e := start(t)
	connectHost(t, e)
	vm := adminVM(t, e, "web-1")
	other := adminVM(t, e, "web-2")
	cs := connect(t, e, nil)

	x := ok[eitrimcp.ExposureOut](t, cs, "exposure_create", map[string]any{"vm_id": vm.GetId(), "guest_port": 80}).Exposure
	assert.Regexp(t, `^x-[a-z2-7]{16}$`, x.ID)
	assert.Equal(t, vm.GetId(), x.VMID)
	assert.Equal(t, uint32(80), x.GuestPort)
	assert.NotZero(t, x.HostPort, "a host port is allocated")
	assert.Equal(t, "tcp", x.Protocol)
	assert.Equal(t, "lan", x.Scope)
	assert.Equal(t, "pending", x.State)
	assert.Nil(t, x.Sessions, "nothing counted yet: null, not zeros")

	y := ok[eitrimcp.ExposureOut](t, cs, "exposure_create", map[string]any{
		"vm_id": other.GetId(), "guest_port": 53, "protocol": "udp", "scope": "local", "max_sessions": 7,
	}).Exposure
	assert.Equal(t, "udp", y.Protocol)
	assert.Equal(t, "local", y.Scope)
	assert.Equal(t, uint32(7), y.MaxSessions)

	one := ok[eitrimcp.ExposureListOut](t, cs, "exposure_list", map[string]any{"vm_id": vm.GetId()}).Exposures
	require.Len(t, one, 1)
	assert.Equal(t, x, one[0])
	assert.Len(t, ok[eitrimcp.ExposureListOut](t, cs, "exposure_list", map[string]any{}).Exposures, 2)

	// The same host port twice is the API's conflict, named.
	msg := refused(t, cs, "exposure_create", map[string]any{"vm_id": vm.GetId(), "guest_port": 81, "host_port": x.HostPort})
	assert.Contains(t, msg, "host_port")

	del := ok[eitrimcp.ExposureDeleteOut](t, cs, "exposure_delete", map[string]any{"id": x.ID})
	assert.Equal(t, x.ID, del.DeletedID)
	assert.Empty(t, ok[eitrimcp.ExposureListOut](t, cs, "exposure_list", map[string]any{"vm_id": vm.GetId()}).Exposures)
	assert.Contains(t, refused(t, cs, "exposure_delete", map[string]any{"id": x.ID}), "not_found: ")

	// The timeline says what was published and unpublished.
	evs := ok[eitrimcp.VMEventsOut](t, cs, "vm_events", map[string]any{"vm_id": vm.GetId()}).Events
	var kinds []string
	for _, ev := range evs {
		kinds = append(kinds, ev.Kind)
	}
	assert.Equal(t, []string{"created", "exposure", "exposure"}, kinds)

	// A deleted VM takes no new exposure.
	ok[eitrimcp.VM](t, cs, "vm_delete", map[string]any{"id": vm.GetId()})
	assert.Contains(t, refused(t, cs, "exposure_create", map[string]any{"vm_id": vm.GetId(), "guest_port": 80}),
		"failed_precondition: vm "+vm.GetId()+" is deleted")
}
