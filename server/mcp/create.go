package mcp

import (
	"context"
	"fmt"
	"time"

	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/bounds"
	"github.com/a73x/eitri/wire/vmstate"
)

// defaultWait is how long vm_create waits for ready when the caller does not
// say: long enough for a multi-GiB image download on a slow link.
const defaultWait = 600 * time.Second

// notListed is the narration before the VM's host has listed it in a
// report: the control plane has the VM, the host has not said a word on it.
const notListed = "not listed yet"

// VMCreateIn is vm_create's input: every field CreateVM takes, and how long
// to wait.
type VMCreateIn struct {
	Name             string `json:"name" jsonschema:"a DNS label unique among your VMs: lowercase letters, digits and '-', 1-63 characters, no leading or trailing '-'"`
	Image            string `json:"image,omitempty" jsonschema:"a catalogue image name (image_list shows them), e.g. debian-12; or give image_url and image_sha256 instead"`
	ImageURL         string `json:"image_url,omitempty" jsonschema:"without image: http(s) URL of a raw, gzip raw or qcow2 image"`
	ImageSHA256      string `json:"image_sha256,omitempty" jsonschema:"with image_url: sha256 of the image as served, 64 lowercase hex characters"`
	VCPUs            int32  `json:"vcpus" jsonschema:"virtual CPUs"`
	MemMB            int64  `json:"mem_mb" jsonschema:"memory in MiB"`
	DiskGB           int64  `json:"disk_gb" jsonschema:"root disk size in GiB"`
	SSHAuthorizedKey string `json:"ssh_authorized_key,omitempty" jsonschema:"one OpenSSH public key line to authorize in the guest"`
	HostID           string `json:"host_id,omitempty" jsonschema:"the host to place it on, e.g. h-a2b4c6d3e7f3g5h2; empty picks the connected host with the most free capacity"`
	PowerState       string `json:"power_state,omitempty" jsonschema:"running (the default) boots it once created; stopped creates its disk and leaves it off"`
	WaitSeconds      int    `json:"wait_seconds,omitempty" jsonschema:"how long to wait for the VM to be ready (or created and stopped) before returning; 0 means 600"`
}

// VMCreateOut is the VM, ready or still on its way.
type VMCreateOut struct {
	VM   VM     `json:"vm"`
	Note string `json:"note,omitempty" jsonschema:"set when the VM was not done in time (it is still being created, not failed) or could not be followed"`
}

var vmCreateSchema = schemaFor[VMCreateIn](func(p map[string]*jsonschema.Schema) {
	length(p["name"], 1, bounds.MaxNameLen)
	length(p["image"], 0, bounds.MaxNameLen)
	length(p["image_url"], 0, bounds.MaxURLLen)
	length(p["image_sha256"], 0, 64) // the fleet says what a sha256 looks like
	between(p["vcpus"], bounds.MinVCPUs, bounds.MaxVCPUs)
	between(p["mem_mb"], bounds.MinMemMB, bounds.MaxMemMB)
	between(p["disk_gb"], bounds.MinDiskGB, bounds.MaxDiskGB)
	length(p["ssh_authorized_key"], 0, bounds.MaxSSHKeyLen)
	length(p["host_id"], 0, bounds.MaxIDLen)
	oneOf(p["power_state"], vmstate.PowerRunning, vmstate.PowerStopped)
	atLeast(p["wait_seconds"], 0)
})

func (t *tools) registerCreate(s *mcp.Server) {
	addTool(t, s, &mcp.Tool{
		Name: "vm_create",
		Description: "Create a VM and wait until it is ready with an address (or, with power_state stopped, " +
			"created and off), reporting each step the host takes (image download with bytes done and total, " +
			"disk, boot) as progress. If it is not done within wait_seconds the VM is returned with a note: it " +
			"is still being created, not failed; follow it with vm_get.",
		InputSchema: vmCreateSchema,
	}, t.vmCreate)
}

func (t *tools) vmCreate(ctx context.Context, req *mcp.CallToolRequest, in VMCreateIn) (VMCreateOut, error) {
	wait := defaultWait
	if in.WaitSeconds < 0 {
		return VMCreateOut{}, &fleet.Error{Kind: fleet.Invalid, Msg: "wait_seconds: must not be negative"}
	} else if in.WaitSeconds > 0 {
		wait = time.Duration(in.WaitSeconds) * time.Second
	}
	vm, err := t.f.CreateVM(ctx, &eitriv1.CreateVMRequest{
		Name: in.Name, Image: in.Image, ImageUrl: in.ImageURL, ImageSha256: in.ImageSHA256,
		Vcpus: in.VCPUs, MemMb: in.MemMB, DiskGb: in.DiskGB,
		SshAuthorizedKey: in.SSHAuthorizedKey, HostId: in.HostID, PowerState: in.PowerState,
	})
	if err != nil {
		return VMCreateOut{}, err
	}
	return t.waitDone(ctx, req, vm, wait)
}

// waitDone follows the VM through the watch hub until it is ready with an
// address (or created and stopped, when asked for stopped), narrating each
// change as a progress notification. Running out of time is not failure:
// the host is still working, so the VM comes back with a note saying so.
func (t *tools) waitDone(ctx context.Context, req *mcp.CallToolRequest, vm *eitriv1.VM, wait time.Duration) (VMCreateOut, error) {
	// The wait is a watch stream like WatchVMs and counts against the same
	// quota. The VM exists either way, so a refused wait returns it.
	release, err := t.f.OpenStream(ctx)
	if err != nil {
		return t.unfollowed(req, vm, err)
	}
	defer release()
	// Subscribing after the create is safe: WatchVMs subscribes before it
	// reads the list, so the list holds every change made until then.
	w, list, err := t.f.WatchVMs(ctx, vm.GetId()) // this VM alone
	if err != nil {
		return t.unfollowed(req, vm, err)
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
		if done, err := settled(vm); done || err != nil {
			if err != nil {
				return VMCreateOut{}, err
			}
			return VMCreateOut{VM: vmOut(vm)}, nil
		}
		next, gone, err := nextState(waitCtx, w, vm.GetId())
		switch {
		case ctx.Err() != nil:
			return VMCreateOut{}, ctx.Err()
		case err != nil: // our own deadline
			return VMCreateOut{VM: vmOut(vm), Note: fmt.Sprintf(
				"vm %s is still being created (%s) after %s; this is not a failure: check it with vm_get",
				vm.GetName(), words(vm), wait)}, nil
		case gone:
			return VMCreateOut{}, &toolErr{fmt.Sprintf("vm %s (%s) was removed while it was being created", vm.GetName(), vm.GetId())}
		}
		vm = next
	}
}

// unfollowed returns a created VM the wait could not follow, saying why:
// the create happened, so an error here would read as a failed create.
func (t *tools) unfollowed(req *mcp.CallToolRequest, vm *eitriv1.VM, err error) (VMCreateOut, error) {
	why := "could not follow it"
	if fleet.KindOf(err) != fleet.Internal {
		why = err.Error()
	} else {
		t.log.Error("mcp: follow created vm", "tool", req.Params.Name, "vm", vm.GetId(), "err", err)
	}
	return VMCreateOut{VM: vmOut(vm), Note: fmt.Sprintf(
		"vm %s was created but is not being followed (%s): check it with vm_get", vm.GetName(), why)}, nil
}

// settled says whether the create is over: done when the VM is as asked
// (ready with an address, or stopped when created stopped), an error when
// it never will be.
func settled(vm *eitriv1.VM) (bool, error) {
	switch lc := vm.GetLifecycle(); {
	case vm.GetDeleted():
		return false, &toolErr{fmt.Sprintf("vm %s (%s) was deleted while it was being created", vm.GetName(), vm.GetId())}
	case lc == vmstate.LifecycleFailed, lc == vmstate.LifecycleLost:
		msg := vm.GetLastError()
		if msg == "" {
			msg = "no error reported"
		}
		return false, &toolErr{fmt.Sprintf("vm %s (%s) %s: %s", vm.GetName(), vm.GetId(), lc, msg)}
	case vm.GetPowerState() == vmstate.PowerStopped:
		// Readiness of a guest that is meant to be off is its disk being
		// made and the host holding it stopped.
		return lc == vmstate.LifecycleStopped, nil
	default:
		return lc == vmstate.LifecycleReady && vm.GetAssignedIp() != "", nil
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

// progress sends a notification each time the narration or the measure
// changes, and only when the client asked for progress.
//
// The numbers are the VM's structured progress when it has one: bytes done
// as progress, the step's total (when known) as total, so a client's bar is
// the host's own count. A step with no measure carries the last number sent
// and no total: MCP wants progress never to go back, and a bar without a
// total draws as "working", which is what such a step is.
type progress struct {
	req   *mcp.CallToolRequest
	sent  bool
	msg   string
	value float64
	total float64
}

func (p *progress) report(ctx context.Context, vm *eitriv1.VM) {
	msg := fmt.Sprintf("creating vm %s: %s", vm.GetName(), words(vm))
	value, total := p.value, 0.0
	if m := vm.GetProgress(); m != nil {
		value = float64(m.GetDoneBytes())
		if m.TotalBytes != nil {
			total = float64(m.GetTotalBytes())
		}
	}
	if p.sent && msg == p.msg && value == p.value && total == p.total {
		return
	}
	p.sent, p.msg, p.value, p.total = true, msg, value, total
	tok := p.req.Params.GetProgressToken()
	if tok == nil || p.req.Session == nil {
		return
	}
	// A lost notification is only lost narration; the wait goes on.
	_ = p.req.Session.NotifyProgress(ctx, &mcp.ProgressNotificationParams{
		ProgressToken: tok, Message: msg, Progress: value, Total: total,
	})
}

// words is the lifecycle plus the host's own account of the step while it
// narrates one (vmstate.Narrated); before the host has listed the VM in a report there is nothing to
// narrate but that.
func words(vm *eitriv1.VM) string {
	s := vm.GetLifecycle()
	if vm.GetPhase() == "" && (s == "" || s == vmstate.LifecyclePending) {
		return notListed
	}
	if d := vm.GetStatusDetail(); d != "" && vmstate.Narrated(s) {
		s += ", " + d
	}
	return s
}
