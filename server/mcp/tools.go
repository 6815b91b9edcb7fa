package mcp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/server/watch"
)

// defaultWait is how long vm_create waits for ready when the caller does not
// say: long enough for a multi-GiB image download on a slow link.
const defaultWait = 600 * time.Second

// VMSummary is one row of vm_list.
type VMSummary struct {
	ID           string `json:"id"`
	Name         string `json:"name"`
	Lifecycle    string `json:"lifecycle" jsonschema:"pending, creating, ready, stopped, failed, deleting or unknown"`
	StatusDetail string `json:"status_detail,omitempty" jsonschema:"what the host is doing right now, e.g. downloading image 1.2/3.7 GiB"`
	AssignedIP   string `json:"assigned_ip,omitempty"`
	HostID       string `json:"host_id"`
}

// VM is one VM in full.
type VM struct {
	ID            string `json:"id"`
	Name          string `json:"name"`
	Lifecycle     string `json:"lifecycle" jsonschema:"pending, creating, ready, stopped, failed, deleting or unknown"`
	StatusDetail  string `json:"status_detail,omitempty" jsonschema:"what the host is doing right now"`
	AssignedIP    string `json:"assigned_ip,omitempty"`
	HostID        string `json:"host_id"`
	PowerState    string `json:"power_state" jsonschema:"desired power: running or stopped"`
	ActualPower   string `json:"actual_power,omitempty"`
	LastError     string `json:"last_error,omitempty"`
	ImageURL      string `json:"image_url"`
	ImageSHA256   string `json:"image_sha256"`
	VCPUs         int32  `json:"vcpus"`
	MemMB         int64  `json:"mem_mb"`
	DiskGB        int64  `json:"disk_gb"`
	Deleted       bool   `json:"deleted,omitempty"`
	DestroyAt     string `json:"destroy_at,omitempty" jsonschema:"when a deleted VM is destroyed for good (RFC 3339); restorable until then"`
	SSHHostPubkey string `json:"ssh_host_pubkey,omitempty"`
}

// VMListIn takes nothing.
type VMListIn struct{}

// VMListOut is the caller's VMs (everyone's, for an admin).
type VMListOut struct {
	VMs []VMSummary `json:"vms"`
}

// VMIDIn names one VM.
type VMIDIn struct {
	ID string `json:"id" jsonschema:"the VM id (vm_...)"`
}

// VMCreateIn is vm_create's input.
type VMCreateIn struct {
	Name             string `json:"name" jsonschema:"DNS label: lowercase letters, digits and '-', 1-63 characters"`
	ImageURL         string `json:"image_url" jsonschema:"http(s) URL of a raw, gzip raw or qcow2 image"`
	ImageSHA256      string `json:"image_sha256" jsonschema:"sha256 of the image as served, 64 lowercase hex characters"`
	VCPUs            int32  `json:"vcpus"`
	MemMB            int64  `json:"mem_mb" jsonschema:"memory in MiB"`
	DiskGB           int64  `json:"disk_gb" jsonschema:"root disk size in GiB"`
	SSHAuthorizedKey string `json:"ssh_authorized_key,omitempty" jsonschema:"one OpenSSH public key line to authorize in the guest"`
	HostID           string `json:"host_id,omitempty" jsonschema:"host to place it on; empty picks the connected host with the most free capacity"`
	WaitSeconds      int    `json:"wait_seconds,omitempty" jsonschema:"how long to wait for ready before returning (default 600)"`
}

// VMCreateOut is the VM, ready or still on its way.
type VMCreateOut struct {
	VM   VM     `json:"vm"`
	Note string `json:"note,omitempty" jsonschema:"set when the VM was not ready in time; it is still being created"`
}

type tools struct {
	f   *fleet.Fleet
	log *slog.Logger
}

func (t *tools) register(s *mcp.Server) {
	mcp.AddTool(s, &mcp.Tool{
		Name:        "vm_list",
		Description: "List your VMs (all VMs for an admin) with their lifecycle and address.",
	}, authed(t, t.vmList))
	mcp.AddTool(s, &mcp.Tool{
		Name:        "vm_get",
		Description: "Get one VM in full.",
	}, authed(t, t.vmGet))
	mcp.AddTool(s, &mcp.Tool{
		Name: "vm_create",
		Description: "Create a VM and wait until it is ready with an address, reporting each step " +
			"(image download, disk, boot) as progress. If it is not ready within wait_seconds the VM " +
			"is returned with a note: it is still being created, not failed; check it with vm_get.",
	}, authed(t, t.vmCreate))
	mcp.AddTool(s, &mcp.Tool{
		Name:        "vm_start",
		Description: "Set a VM's desired power to running.",
	}, authed(t, func(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
		return t.setPower(ctx, in.ID, fleet.PowerRunning)
	}))
	mcp.AddTool(s, &mcp.Tool{
		Name:        "vm_stop",
		Description: "Set a VM's desired power to stopped.",
	}, authed(t, func(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
		return t.setPower(ctx, in.ID, fleet.PowerStopped)
	}))
	mcp.AddTool(s, &mcp.Tool{
		Name:        "vm_delete",
		Description: "Delete a VM. It stays restorable until destroy_at.",
	}, authed(t, t.vmDelete))
	mcp.AddTool(s, &mcp.Tool{
		Name: "vm_retry",
		Description: "Try a failed VM again with a fresh budget: its host starts over the create or the " +
			"restarts that failed. Only a failed VM can be retried; its last_error says why it failed.",
	}, authed(t, t.vmRetry))
}

// authed runs h as the request's principal and turns fleet errors into tool
// errors that carry the fleet's message (which names the field at fault).
func authed[In, Out any](t *tools, h func(context.Context, *mcp.CallToolRequest, In) (Out, error)) mcp.ToolHandlerFor[In, Out] {
	return func(ctx context.Context, req *mcp.CallToolRequest, in In) (*mcp.CallToolResult, Out, error) {
		var zero Out
		ctx, err := withPrincipal(ctx, req)
		if err != nil {
			return nil, zero, err
		}
		out, err := h(ctx, req, in)
		if err != nil {
			return nil, zero, t.toolError(req, err)
		}
		return nil, out, nil
	}
}

// toolError keeps the messages meant for callers and hides the rest
// (store and I/O errors), which go to the log instead.
func (t *tools) toolError(req *mcp.CallToolRequest, err error) error {
	var fe *fleet.Error
	var te *toolErr
	switch {
	case errors.As(err, &fe), errors.As(err, &te):
		return err
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return errors.New("cancelled")
	}
	t.log.Error("mcp tool", "tool", req.Params.Name, "err", err)
	return errors.New("internal error")
}

// toolErr is an error this package words for the caller.
type toolErr struct{ msg string }

func (e *toolErr) Error() string { return e.msg }

func (t *tools) vmList(ctx context.Context, _ *mcp.CallToolRequest, _ VMListIn) (VMListOut, error) {
	vms, err := t.f.ListVMs(ctx)
	if err != nil {
		return VMListOut{}, err
	}
	out := VMListOut{VMs: make([]VMSummary, 0, len(vms))}
	for _, v := range vms {
		out.VMs = append(out.VMs, VMSummary{
			ID: v.GetId(), Name: v.GetName(), Lifecycle: v.GetLifecycle(), StatusDetail: v.GetStatusDetail(),
			AssignedIP: v.GetAssignedIp(), HostID: v.GetHostId(),
		})
	}
	return out, nil
}

func (t *tools) vmGet(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
	v, err := t.f.GetVM(ctx, in.ID)
	if err != nil {
		return VM{}, err
	}
	return vmOut(v), nil
}

func (t *tools) setPower(ctx context.Context, id, power string) (VM, error) {
	v, err := t.f.SetPower(ctx, id, power)
	if err != nil {
		return VM{}, err
	}
	return vmOut(v), nil
}

func (t *tools) vmDelete(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
	v, err := t.f.DeleteVM(ctx, in.ID)
	if err != nil {
		return VM{}, err
	}
	return vmOut(v), nil
}

func (t *tools) vmRetry(ctx context.Context, _ *mcp.CallToolRequest, in VMIDIn) (VM, error) {
	v, err := t.f.RetryVM(ctx, in.ID)
	if err != nil {
		return VM{}, err
	}
	return vmOut(v), nil
}

func (t *tools) vmCreate(ctx context.Context, req *mcp.CallToolRequest, in VMCreateIn) (VMCreateOut, error) {
	wait := defaultWait
	if in.WaitSeconds < 0 {
		return VMCreateOut{}, &toolErr{"wait_seconds: must not be negative"}
	} else if in.WaitSeconds > 0 {
		wait = time.Duration(in.WaitSeconds) * time.Second
	}
	vm, err := t.f.CreateVM(ctx, &eitriv1.CreateVMRequest{
		Name: in.Name, ImageUrl: in.ImageURL, ImageSha256: in.ImageSHA256,
		Vcpus: in.VCPUs, MemMb: in.MemMB, DiskGb: in.DiskGB,
		SshAuthorizedKey: in.SSHAuthorizedKey, HostId: in.HostID,
	})
	if err != nil {
		return VMCreateOut{}, err
	}
	return t.waitReady(ctx, req, vm, wait)
}

// waitReady follows the VM through the watch hub until it is ready with an
// address, narrating each change as a progress notification. Running out of
// time is not failure: the host is still working, so the VM comes back with
// a note saying so.
func (t *tools) waitReady(ctx context.Context, req *mcp.CallToolRequest, vm *eitriv1.VM, wait time.Duration) (VMCreateOut, error) {
	// Subscribing after the create is safe: WatchVMs subscribes before it
	// reads the list, so the list holds every change made until then.
	w, list, err := t.f.WatchVMs(ctx)
	if err != nil {
		return VMCreateOut{}, err
	}
	defer w.Close()
	for _, v := range list {
		if v.GetId() == vm.GetId() {
			vm = v
		}
	}

	waitCtx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	p := progress{req: req}
	for {
		p.report(ctx, vm)
		switch {
		case vm.GetLifecycle() == "ready" && vm.GetAssignedIp() != "":
			return VMCreateOut{VM: vmOut(vm)}, nil
		case vm.GetLifecycle() == "failed":
			msg := vm.GetLastError()
			if msg == "" {
				msg = "no error reported"
			}
			return VMCreateOut{}, &toolErr{fmt.Sprintf("vm %s (%s) failed: %s", vm.GetName(), vm.GetId(), msg)}
		case vm.GetDeleted():
			return VMCreateOut{}, &toolErr{fmt.Sprintf("vm %s (%s) was deleted while it was being created", vm.GetName(), vm.GetId())}
		}
		next, gone, err := nextState(waitCtx, w, vm.GetId())
		switch {
		case ctx.Err() != nil:
			return VMCreateOut{}, ctx.Err()
		case err != nil: // our own deadline
			return VMCreateOut{VM: vmOut(vm), Note: fmt.Sprintf(
				"vm %s is still being created (lifecycle %s) after %s; this is not a failure: check it with vm_get",
				vm.GetName(), words(vm), wait)}, nil
		case gone:
			return VMCreateOut{}, &toolErr{fmt.Sprintf("vm %s (%s) was removed while it was being created", vm.GetName(), vm.GetId())}
		}
		vm = next
	}
}

// nextState blocks until the watcher has a newer state of VM id; gone reports
// its removal.
func nextState(ctx context.Context, w *watch.Watcher[*eitriv1.VM], id string) (*eitriv1.VM, bool, error) {
	for {
		evs, err := w.Next(ctx)
		if err != nil {
			return nil, false, err
		}
		var latest *eitriv1.VM
		for _, ev := range evs {
			if ev.ID != id {
				continue
			}
			if ev.Removed {
				return nil, true, nil
			}
			latest = ev.Obj
		}
		if latest != nil {
			return latest, false, nil
		}
	}
}

// progress sends a notification each time the narration changes, and only
// when the client asked for progress.
type progress struct {
	req  *mcp.CallToolRequest
	last string
	n    float64
}

func (p *progress) report(ctx context.Context, vm *eitriv1.VM) {
	msg := fmt.Sprintf("creating vm %s: %s", vm.GetName(), words(vm))
	if msg == p.last {
		return
	}
	p.last = msg
	tok := p.req.Params.GetProgressToken()
	if tok == nil || p.req.Session == nil {
		return
	}
	p.n++
	// A lost notification is only lost narration; the wait goes on.
	_ = p.req.Session.NotifyProgress(ctx, &mcp.ProgressNotificationParams{ProgressToken: tok, Message: msg, Progress: p.n})
}

// words is the lifecycle plus the host's own account of the step, if any.
func words(vm *eitriv1.VM) string {
	s := vm.GetLifecycle()
	if s == "" {
		s = "pending"
	}
	if d := vm.GetStatusDetail(); d != "" {
		s += ", " + d
	}
	return s
}

func vmOut(v *eitriv1.VM) VM {
	out := VM{
		ID: v.GetId(), Name: v.GetName(), Lifecycle: v.GetLifecycle(), StatusDetail: v.GetStatusDetail(),
		AssignedIP: v.GetAssignedIp(), HostID: v.GetHostId(), PowerState: v.GetPowerState(),
		ActualPower: v.GetActualPower(), LastError: v.GetLastError(),
		ImageURL: v.GetImageUrl(), ImageSHA256: v.GetImageSha256(),
		VCPUs: v.GetVcpus(), MemMB: v.GetMemMb(), DiskGB: v.GetDiskGb(),
		Deleted: v.GetDeleted(), SSHHostPubkey: v.GetSshHostPubkey(),
	}
	if v.GetDestroyAt() != nil {
		out.DestroyAt = v.GetDestroyAt().AsTime().UTC().Format(time.RFC3339)
	}
	return out
}
