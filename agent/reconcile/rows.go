package reconcile

import (
	"context"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// observe reads power and address and builds the VM's settled row.
// waitPhase is its phase while it runs without an address (creating, or
// starting).
func (e *Engine) observe(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, lastErr, waitPhase string) outcome {
	running, err := e.cfg.Hyper.Power(ctx, d.GetVmId())
	if err != nil {
		return outcome{row: unknownPowerRow(d.GetVmId(), rec, nil, err)}
	}
	return e.observeKnown(ctx, d, rec, running, lastErr, waitPhase)
}

// observeKnown builds the row for a guest whose power is known. Ready needs
// an address the guest took in its current boot: an address remembered
// from an earlier boot says nothing about whether this one came up.
func (e *Engine) observeKnown(ctx context.Context, d *eitriv1.VMDesired, rec state.Record, running bool, lastErr, waitPhase string) outcome {
	id := d.GetVmId()
	rec, leased := e.refreshAddress(ctx, id, rec)
	if !running {
		return outcome{row: newRow(id, rec, vmstate.PowerStopped, vmstate.PhaseStopped, lastErr, "")}
	}
	if !leased {
		return outcome{row: newRow(id, rec, vmstate.PowerRunning, waitPhase, lastErr, SayWaitingForAddress)}
	}
	signal, ready := e.cfg.Hyper.Ready(ctx, id, rec.Spec.Readiness)
	if !ready {
		return outcome{row: newRow(id, rec, vmstate.PowerRunning, waitPhase, lastErr, sayWaitingForReady)}
	}
	if rec.FirstBoot {
		rec.FirstBoot = false
		e.save(id, rec)
	}
	row := newRow(id, rec, vmstate.PowerRunning, vmstate.PhaseReady, lastErr, "")
	row.ReadySignal = signal
	return outcome{row: row}
}

// refreshAddress records a newly learned guest address; leased says the
// guest holds one now.
func (e *Engine) refreshAddress(ctx context.Context, id string, rec state.Record) (state.Record, bool) {
	addr, ok := e.cfg.Hyper.Address(ctx, id)
	if !ok || !addr.IsValid() {
		return rec, false
	}
	if addr.String() == rec.IP {
		return rec, true
	}
	rec.IP = addr.String()
	if err := e.cfg.St.SaveVM(id, rec); err != nil {
		e.log.Error("saving VM address", "vm", id, "err", err)
	}
	return rec, true
}

// newRow builds a report row. Every row carries the guest's public host key
// for as long as the VM exists.
func newRow(id string, rec state.Record, power, phase, lastErr, detail string) *eitriv1.ActualVM {
	row := &eitriv1.ActualVM{
		VmId:            id,
		Power:           power,
		Phase:           phase,
		Ip:              rec.IP,
		LastError:       lastErr,
		SshHostPubkey:   rec.HostPubKey,
		StatusDetail:    detail,
		Retry:           rec.Retry,
		UnexpectedExits: uint32(rec.Exits),
		LoginUser:       rec.LoginUser,
	}
	if x := rec.LastExit; x != nil {
		row.LastExit = &eitriv1.GuestExit{Reason: x.Reason, SerialTail: x.SerialTail, AtUnix: x.At.Unix()}
	}
	return row
}

// unknownPowerRow is the row for a VM whose power could not be read: the last
// known power and phase stand (absent if none was known), with the error.
func unknownPowerRow(id string, rec state.Record, prev *eitriv1.ActualVM, err error) *eitriv1.ActualVM {
	power, phase := "", vmstate.PhaseStopped
	if prev != nil && prev.GetPhase() != "" {
		power, phase = prev.GetPower(), prev.GetPhase()
	}
	detail, progress := "", (*eitriv1.Progress)(nil)
	if phase == vmstate.PhaseCreating {
		detail, progress = prev.GetStatusDetail(), prev.GetProgress()
	}
	row := newRow(id, rec, power, phase, err.Error(), detail)
	row.Progress = progress // published rows are never modified: sharing is safe
	return row
}

func powerWord(running bool) string {
	if running {
		return vmstate.PowerRunning
	}
	return vmstate.PowerStopped
}
