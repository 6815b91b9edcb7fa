package mcp

import (
	"context"
	"time"

	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/wire/vmstate"
)

// Progress is the measured part of the host's current step.
type Progress struct {
	Step       string  `json:"step" jsonschema:"what is measured, e.g. download"`
	DoneBytes  uint64  `json:"done_bytes"`
	TotalBytes *uint64 `json:"total_bytes" jsonschema:"null while the size is not known"`
}

// VMSummary is one row of vm_list.
type VMSummary struct {
	ID           string    `json:"id"`
	Name         string    `json:"name"`
	Lifecycle    string    `json:"lifecycle" jsonschema:"one of: pending, creating, ready, stopped, failed, deleting, starting, stopping, restoring, retrying, restarting, unknown or lost"`
	StatusDetail string    `json:"status_detail,omitempty" jsonschema:"what the host is doing right now, e.g. downloading image 1.2/3.7 GiB"`
	Progress     *Progress `json:"progress" jsonschema:"the current step's measure (bytes done and total); null when the step has none"`
	AssignedIP   string    `json:"assigned_ip,omitempty"`
	HostID       string    `json:"host_id"`
	Deleted      bool      `json:"deleted,omitempty"`
}

// VM is one VM in full.
type VM struct {
	ID               string    `json:"id"`
	Name             string    `json:"name"`
	OwnerID          string    `json:"owner_id"`
	Lifecycle        string    `json:"lifecycle" jsonschema:"one of: pending, creating, ready, stopped, failed, deleting, starting, stopping, restoring, retrying, restarting, unknown or lost"`
	StatusDetail     string    `json:"status_detail,omitempty" jsonschema:"what the host is doing right now, in its words"`
	Progress         *Progress `json:"progress" jsonschema:"the current step's measure (bytes done and total); null when the step has none"`
	AssignedIP       string    `json:"assigned_ip,omitempty" jsonschema:"the guest's address on its host's bridge; empty until it has leased one"`
	HostID           string    `json:"host_id"`
	PowerState       string    `json:"power_state" jsonschema:"desired power: running or stopped"`
	ActualPower      string    `json:"actual_power,omitempty" jsonschema:"running or stopped as the host last said; empty when it is not reporting"`
	LastError        string    `json:"last_error,omitempty" jsonschema:"why the VM failed, as its host said"`
	ImageName        string    `json:"image_name,omitempty" jsonschema:"the catalogue image it was created by; empty for an image URL"`
	ImageVersion     int64     `json:"image_version,omitempty" jsonschema:"the catalogue version of image_name it was made from"`
	ImageURL         string    `json:"image_url"`
	ImageSHA256      string    `json:"image_sha256" jsonschema:"the digest it was made from"`
	VCPUs            int32     `json:"vcpus"`
	MemMB            int64     `json:"mem_mb"`
	DiskGB           int64     `json:"disk_gb"`
	SSHAuthorizedKey string    `json:"ssh_authorized_key,omitempty"`
	SSHHostPubkey    string    `json:"ssh_host_pubkey,omitempty" jsonschema:"the guest's SSH host key, to check the first connection against"`
	CreatedAt        string    `json:"created_at,omitempty" jsonschema:"RFC 3339"`
	Deleted          bool      `json:"deleted,omitempty"`
	DestroyAt        string    `json:"destroy_at,omitempty" jsonschema:"when a deleted VM is destroyed for good (RFC 3339)"`
	RestorableUntil  string    `json:"restorable_until,omitempty" jsonschema:"until when vm_restore can bring a deleted VM back (RFC 3339)"`
}

// VMListIn takes nothing.
type VMListIn struct{}

// VMListOut is the caller's VMs (everyone's, for an admin).
type VMListOut struct {
	VMs []VMSummary `json:"vms"`
}

// VMIDIn names one VM.
type VMIDIn struct {
	ID string `json:"id" jsonschema:"the VM's id, e.g. vm-k3j5x7q2m4n6p2r5 (vm_list shows them)"`
}

// VMEventsIn names the VM whose timeline to read, and which page.
type VMEventsIn struct {
	VMID      string `json:"vm_id" jsonschema:"the VM's id, e.g. vm-k3j5x7q2m4n6p2r5"`
	PageSize  int32  `json:"page_size,omitempty" jsonschema:"the most events to return: 0 or unset is 100, at most 1000"`
	PageToken string `json:"page_token,omitempty" jsonschema:"unset for the newest events; next_page_token of the last call for the ones before them"`
}

// VMEvent is one entry of a VM's timeline.
type VMEvent struct {
	At      string `json:"at" jsonschema:"RFC 3339"`
	Kind    string `json:"kind" jsonschema:"a short word: created, status, power, deleted, restored, exited, retried, exposure, ..."`
	Message string `json:"message"`
}

// VMEventsOut is a page of the timeline, oldest first.
type VMEventsOut struct {
	Events        []VMEvent `json:"events"`
	NextPageToken string    `json:"next_page_token,omitempty" jsonschema:"pass as page_token for the older events; absent when there are none"`
}

var vmIDSchema = schemaFor[VMIDIn](func(p map[string]*jsonschema.Schema) { idProp(p["id"], exampleVMID) })

func (t *tools) registerVMs(s *mcp.Server) {
	addTool(t, s, &mcp.Tool{
		Name:        "vm_list",
		Description: "List your VMs (every VM for an admin) with their lifecycle, the host's current step and address.",
	}, t.vmList)
	addTool(t, s, &mcp.Tool{
		Name:        "vm_get",
		Description: "Get one VM in full.",
		InputSchema: vmIDSchema,
	}, t.vmGet)
	addTool(t, s, &mcp.Tool{
		Name:        "vm_start",
		Description: "Set a VM's desired power to running; its host starts it.",
		InputSchema: vmIDSchema,
	}, func(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
		return vmResult(t.f.SetPower(ctx, in.ID, vmstate.PowerRunning))
	})
	addTool(t, s, &mcp.Tool{
		Name:        "vm_stop",
		Description: "Set a VM's desired power to stopped; its host shuts it down.",
		InputSchema: vmIDSchema,
	}, func(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
		return vmResult(t.f.SetPower(ctx, in.ID, vmstate.PowerStopped))
	})
	addTool(t, s, &mcp.Tool{
		Name: "vm_delete",
		Description: "Delete a VM: its guest stops and its disk is kept until destroy_at; vm_restore brings it " +
			"back until restorable_until.",
		InputSchema: vmIDSchema,
	}, func(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
		return vmResult(t.f.DeleteVM(ctx, in.ID))
	})
	addTool(t, s, &mcp.Tool{
		Name: "vm_restore",
		Description: "Bring a deleted VM back before restorable_until, with the same disk. Its vCPUs and memory " +
			"must fit your quota and its host again.",
		InputSchema: vmIDSchema,
	}, func(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
		return vmResult(t.f.RestoreVM(ctx, in.ID))
	})
	addTool(t, s, &mcp.Tool{
		Name: "vm_retry",
		Description: "Try a failed VM again with a fresh budget: its host starts over the create or the " +
			"restarts that failed. Only a failed VM can be retried; its last_error says why it failed.",
		InputSchema: vmIDSchema,
	}, func(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
		return vmResult(t.f.RetryVM(ctx, in.ID))
	})
	addTool(t, s, &mcp.Tool{
		Name: "vm_events",
		Description: "A VM's timeline, oldest first: created, status changes, power requests, exits of the " +
			"guest (with its console's last lines), deletes, restores, retries, exposures and tunnels. It comes " +
			"a page at a time, the newest first: next_page_token, passed back as page_token, reads the events before.",
		InputSchema: schemaFor[VMEventsIn](func(p map[string]*jsonschema.Schema) {
			idProp(p["vm_id"], exampleVMID)
			between(p["page_size"], 0, fleet.MaxVMEventsPage)
		}),
	}, t.vmEvents)
}

func (t *tools) vmList(ctx context.Context, _ *mcp.CallToolRequest, _ VMListIn) (VMListOut, error) {
	vms, err := t.f.ListVMs(ctx)
	if err != nil {
		return VMListOut{}, err
	}
	out := VMListOut{VMs: make([]VMSummary, 0, len(vms))}
	for _, v := range vms {
		out.VMs = append(out.VMs, VMSummary{
			ID: v.GetId(), Name: v.GetName(), Lifecycle: v.GetLifecycle(), StatusDetail: v.GetStatusDetail(),
			Progress: progressOut(v.GetProgress()), AssignedIP: v.GetAssignedIp(), HostID: v.GetHostId(),
			Deleted: v.GetDeleted(),
		})
	}
	return out, nil
}

func (t *tools) vmGet(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
	return vmResult(t.f.GetVM(ctx, in.ID))
}

func (t *tools) vmEvents(ctx context.Context, _ *mcp.CallToolRequest, in VMEventsIn) (VMEventsOut, error) {
	r, err := t.f.ListVMEvents(ctx, &eitriv1.ListVMEventsRequest{VmId: in.VMID, PageSize: in.PageSize, PageToken: in.PageToken})
	if err != nil {
		return VMEventsOut{}, err
	}
	evs := r.GetEvents()
	out := VMEventsOut{Events: make([]VMEvent, len(evs)), NextPageToken: r.GetNextPageToken()}
	for i, e := range evs {
		out.Events[i] = VMEvent{At: rfc3339(e.GetAt()), Kind: e.GetKind(), Message: e.GetMessage()}
	}
	return out, nil
}

func vmResult(v *eitriv1.VM, err error) (VM, error) {
	if err != nil {
		return VM{}, err
	}
	return vmOut(v), nil
}

func vmOut(v *eitriv1.VM) VM {
	return VM{
		ID: v.GetId(), Name: v.GetName(), OwnerID: v.GetOwnerId(), Lifecycle: v.GetLifecycle(),
		StatusDetail: v.GetStatusDetail(), Progress: progressOut(v.GetProgress()),
		AssignedIP: v.GetAssignedIp(), HostID: v.GetHostId(), PowerState: v.GetPowerState(),
		ActualPower: v.GetActualPower(), LastError: v.GetLastError(),
		ImageName: v.GetImageName(), ImageVersion: v.GetImageVersion(),
		ImageURL: v.GetImageUrl(), ImageSHA256: v.GetImageSha256(),
		VCPUs: v.GetVcpus(), MemMB: v.GetMemMb(), DiskGB: v.GetDiskGb(),
		SSHAuthorizedKey: v.GetSshAuthorizedKey(), SSHHostPubkey: v.GetSshHostPubkey(),
		CreatedAt: rfc3339(v.GetCreatedAt()), Deleted: v.GetDeleted(),
		DestroyAt: rfc3339(v.GetDestroyAt()), RestorableUntil: rfc3339(v.GetRestorableUntil()),
	}
}

// progressOut keeps null as null: a step with no measure is not 0 of 0.
func progressOut(p *eitriv1.Progress) *Progress {
	if p == nil {
		return nil
	}
	out := &Progress{Step: p.GetStep(), DoneBytes: p.GetDoneBytes()}
	if p.TotalBytes != nil {
		total := p.GetTotalBytes()
		out.TotalBytes = &total
	}
	return out
}

// rfc3339 is "" for an unset time.
func rfc3339(ts *timestamppb.Timestamp) string {
	if ts == nil {
		return ""
	}
	return ts.AsTime().UTC().Format(time.RFC3339)
}
