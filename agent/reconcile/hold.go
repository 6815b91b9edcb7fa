package reconcile

import (
	"context"
	"encoding/json"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// hold keeps a VM the agent will not take the desired state's word on (no
// snapshot names it, or names it with an older record than this host
// applied) as it was: a guest last wanted running stays running (and is
// booted again if it crashed), nothing is stopped and nothing destroyed. It
// is reported held, with its record, until an admin adopts it (a newer
// version) or destroys it. stale: the desired state does name it, so it
// keeps its row too.
func (e *Engine) hold(ctx context.Context, id string, rec state.Record, ok, stale bool, why string) outcome {
	if !ok {
		return outcome{gone: true}
	}
	if rec.QuarantinedAt.IsZero() {
		rec.QuarantinedAt = e.cfg.Now()
		if err := e.cfg.St.SaveVM(id, rec); err != nil {
			e.log.Error("saving held VM record", "vm", id, "err", err)
		}
		e.log.Warn("holding the VM as it is until an admin adopts or destroys it", "vm", id, "why", why)
	}
	power := ""
	running, err := e.cfg.Hyper.Power(ctx, id)
	if err == nil {
		if !running && rec.Power == vmstate.PowerRunning && !rec.Deleted && rec.BootID != "" {
			if err := e.cfg.Hyper.Boot(ctx, rec.Spec, e.cfg.St.SeedPath(id)); err != nil {
				e.log.Warn("booting a held VM failed", "vm", id, "err", err)
			} else if running, err = e.cfg.Hyper.Power(ctx, id); err != nil {
				running = false
			}
		}
		power = powerWord(running)
	}
	spec, err := json.Marshal(rec.Spec)
	if err != nil {
		spec = nil
	}
	held := rec.Power
	if held == "" { // a record from before it was kept: as it is now
		held = power
	}
	out := outcome{quar: &eitriv1.QuarantinedVM{
		VmId:       id,
		Name:       rec.Spec.Name,
		VmspecJson: spec,
		Held: &eitriv1.VMDesired{
			VmId: id, Name: rec.Spec.Name, ImageUrl: rec.Spec.ImageURL, ImageSha256: rec.Spec.ImageSHA256,
			Vcpus: rec.Spec.VCPUs, MemMb: rec.Spec.MemMB, DiskGb: rec.Spec.DiskGB, PowerState: held,
			Deleted: rec.Deleted, SshAuthorizedKey: rec.Spec.SSHAuthorizedKey, Owner: rec.Spec.Owner, Version: rec.Version,
		},
		Power:     power,
		Reason:    why,
		Stale:     stale,
		SinceUnix: rec.QuarantinedAt.Unix(),
	}}
	if stale {
		phase := vmstate.PhaseStopped
		switch {
		case rec.Deleted:
			phase = vmstate.PhaseDeleting
		case rec.BootID == "":
			phase = vmstate.PhaseCreating
		case running && rec.IP != "":
			phase = vmstate.PhaseReady
		case running:
			phase = vmstate.PhaseCreating
		}
		out.row = newRow(id, rec, power, phase, "", "")
	}
	return out
}
