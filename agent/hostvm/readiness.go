package hostvm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"time"

	"github.com/a73x/eitri/agent/reconcile"
	"github.com/a73x/eitri/agent/state"
)

// Readiness signals (ActualVM.ready_signal), strongest first.
const (
	// SignalCloudInit: cloud-init finished and phoned home (or anything
	// else that posted to the VM's phone-home URL).
	SignalCloudInit = "cloud-init"
	// SignalSSH: no phone home within SSHFallbackAfter, but sshd answers
	// on port 22 (an image without cloud-init, or a slow one).
	SignalSSH = "ssh"
	// SignalDHCP: neither within ReadyWait; the guest has its address and
	// that is all the agent can tell.
	SignalDHCP = "dhcp"
)

const (
	// DefaultSSHFallbackAfter: a cloud image under TCG can take a couple of
	// minutes from power-on to the end of cloud-init; past this, an
	// answering sshd is usable enough.
	DefaultSSHFallbackAfter = 3 * time.Minute
	// DefaultReadyWait bounds the wait for either: an appliance image with
	// neither still becomes ready, and says so by its signal.
	DefaultReadyWait = 10 * time.Minute

	// sshProbeEvery spaces one VM's port 22 probes; sshProbeTimeout bounds
	// one (connect and identification line).
	sshProbeEvery   = 2 * time.Second
	sshProbeTimeout = 3 * time.Second
)

// readyMark is a boot found ready: the QEMU start it belongs to and what
// made it ready. A signal, once seen, holds for the rest of that boot
// (sshd stopped later does not make a guest unready).
type readyMark struct {
	boot   time.Time
	signal string
}

// Ready says whether the guest is usable in its current boot, and what said
// so. It needs an address from this boot, then the first of: a phone home
// since the QEMU started; sshd answering once SSHFallbackAfter has passed
// since; ReadyWait having passed since. how changes the waits: with
// ReadinessSSH sshd counts at once, with ReadinessAddress the address alone
// does (an image without cloud-init need not wait ReadyWait for a phone
// home that never comes). Everything it reads survives an agent restart
// (the phone home is kept with the lease, how with the VM's record), so an
// adopted guest is judged as it was.
func (h *Hypervisor) Ready(ctx context.Context, id string, how state.Readiness) (string, bool) {
	started, running := h.qemu.StartedAt(id)
	if !running {
		return "", false
	}
	addr, ok := h.leased(id)
	if !ok {
		return "", false
	}
	h.mu.Lock()
	m, known := h.ready[id]
	h.mu.Unlock()
	if known && m.boot.Equal(started) {
		return m.signal, true
	}
	signal := h.judge(ctx, id, addr, started, time.Now(), how)
	if signal == "" {
		return "", false
	}
	h.mu.Lock()
	h.ready[id] = readyMark{boot: started, signal: signal}
	h.mu.Unlock()
	return signal, true
}

// judge picks the signal that makes the boot started at started ready at
// now, or "" for none yet.
func (h *Hypervisor) judge(ctx context.Context, id string, addr netip.Addr, started, now time.Time, how state.Readiness) string {
	if at, ok := h.net.PhonedHomeAt(id); ok && !at.Before(started) {
		return SignalCloudInit
	}
	if how == state.ReadinessAddress {
		return SignalDHCP
	}
	up := now.Sub(started)
	sshAfter := h.sshAfter
	if how == state.ReadinessSSH {
		sshAfter = 0
	}
	if up >= sshAfter && h.probeDue(id, now) && sshAnswers(ctx, netip.AddrPortFrom(addr, h.sshPort)) {
		return SignalSSH
	}
	if up >= h.readyWait {
		return SignalDHCP
	}
	return ""
}

// probeDue rations port 22 probes: Boot's wait and the engine's passes
// both ask.
func (h *Hypervisor) probeDue(id string, now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if now.Sub(h.probed[id]) < sshProbeEvery {
		return false
	}
	h.probed[id] = now
	return true
}

// sshAnswers says whether an SSH server greets on ap: a connection alone
// is not enough (something may accept and never speak).
func sshAnswers(ctx context.Context, ap netip.AddrPort) bool {
	ctx, cancel := context.WithTimeout(ctx, sshProbeTimeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", ap.String())
	if err != nil {
		return false
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	_ = c.SetReadDeadline(deadline)
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil {
		return false
	}
	return bytes.Equal(buf, []byte("SSH-"))
}

// waitReady waits, after the guest has taken addr, until Ready says it is
// usable, narrating what it waits for. It ends early only when QEMU exits
// (an error with the console) or ctx ends (QEMU keeps running; the next
// attempt, or the engine's next pass, picks it up). Ready's own bounds end
// it otherwise.
func (h *Hypervisor) waitReady(ctx context.Context, id string, addr netip.Addr, how state.Readiness) error {
	switch how {
	case state.ReadinessSSH:
		reconcile.NarrateAddress(ctx, addr, "waiting for ssh")
	case state.ReadinessAddress:
	default:
		reconcile.NarrateAddress(ctx, addr, "waiting for cloud-init")
	}
	start := time.Now()
	tick := time.NewTicker(leasePoll)
	defer tick.Stop()
	saidSSH := false
	for {
		if signal, ok := h.Ready(ctx, id, how); ok {
			h.log.Info("guest is ready", "vm", id, "addr", addr, "signal", signal, "after", time.Since(start).Round(time.Millisecond))
			return nil
		}
		if started, running := h.qemu.StartedAt(id); !running {
			return fmt.Errorf("hostvm: vm %s: QEMU exited before the guest was ready%s", id, h.tail(id))
		} else if !saidSSH && how != state.ReadinessSSH && time.Since(started) >= h.sshAfter {
			saidSSH = true
			reconcile.NarrateAddress(ctx, addr, "no word from cloud-init; waiting for ssh")
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("hostvm: vm %s: not ready yet %s after taking %s: %w",
				id, time.Since(start).Round(time.Second), addr, ctx.Err())
		case <-tick.C:
		}
	}
}
