package fleet

import (
	"strings"
	"unicode/utf8"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// Bounds on what an agent says in words. An enrolled host is trusted to run
// VMs, not to fill the database or every watcher's screen: text past these
// bounds is cut (and marked), never refused, so a report's facts still land.
const (
	maxAgentWord   = 32   // a stable word: a progress step
	maxAgentShort  = 128  // versions, names, addresses, accelerator, ids
	maxAgentLine   = 512  // narration and the accelerator's reason
	maxAgentError  = 4096 // last_error may carry a serial tail
	maxAgentPubkey = 8192 // an authorized_keys line
)

// clip cuts s to at most n bytes on a rune boundary, ending in "…".
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n - len("…")
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "…"
}

// printable drops the control characters from an agent's text but
// newlines and tabs: the rest of C0, DEL, and C1 (U+0080–U+009F, which
// some terminals obey as escapes: U+009B is CSI, U+009D OSC). What a host
// copies from a guest's console reaches the timeline, `eitri vm events` in
// a terminal and every console; a guest tells none of them to move a
// cursor, retitle a window or change colour.
func printable(s string) string {
	if strings.IndexFunc(s, control) < 0 {
		return s
	}
	return strings.Map(func(r rune) rune {
		if control(r) {
			return -1
		}
		return r
	}, s)
}

func control(r rune) bool {
	return r < 0x20 && r != '\n' && r != '\t' || r >= 0x7f && r <= 0x9f
}

// clipFront is clip for text whose end matters most (a console's last
// lines): it keeps the last n bytes, starting with "…".
func clipFront(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := len(s) - (n - len("…"))
	for cut < len(s) && !utf8.RuneStart(s[cut]) {
		cut++
	}
	return "…" + s[cut:]
}

// clipHello bounds the free text of a Hello in place.
func clipHello(h *eitriv1.Hello) {
	h.AgentVersion = clip(h.GetAgentVersion(), maxAgentShort)
	h.Hostname = clip(h.GetHostname(), maxAgentShort)
	h.Address = clip(h.GetAddress(), maxAgentShort)
	h.Accelerator = clip(h.GetAccelerator(), maxAgentShort)
	h.AcceleratorReason = clip(printable(h.GetAcceleratorReason()), maxAgentLine)
	h.InstanceId = clip(h.GetInstanceId(), maxAgentShort)
}

// clipReport bounds the free text of a report in place.
func clipReport(r *eitriv1.ActualStateReport) {
	r.Accelerator = clip(r.GetAccelerator(), maxAgentShort)
	r.AcceleratorReason = clip(printable(r.GetAcceleratorReason()), maxAgentLine)
	for _, v := range r.GetVms() {
		v.Power = clip(v.GetPower(), maxAgentShort)
		v.Phase = clip(v.GetPhase(), maxAgentShort)
		v.Ip = clip(v.GetIp(), maxAgentShort)
		v.StatusDetail = clip(printable(v.GetStatusDetail()), maxAgentLine)
		v.LastError = clip(printable(v.GetLastError()), maxAgentError)
		v.SshHostPubkey = clip(v.GetSshHostPubkey(), maxAgentPubkey)
		v.LoginUser = clip(v.GetLoginUser(), maxAgentShort)
		v.ReadySignal = clip(v.GetReadySignal(), maxAgentShort)
		if x := v.GetLastExit(); x != nil {
			x.Reason = clip(printable(x.GetReason()), maxAgentLine)
			x.SerialTail = clipFront(printable(x.GetSerialTail()), maxAgentError)
		}
		boundProgress(v.GetProgress())
	}
	for _, e := range r.GetExposures() {
		e.State = clip(e.GetState(), maxAgentShort)
		e.Reason = clip(printable(e.GetReason()), maxAgentLine)
	}
}

// boundProgress bounds a row's progress in place: its step is a short word,
// and a total below what is done is dropped rather than believed (which of
// the two numbers lies cannot be told; an unknown total is still true, and
// no watcher is shown a bar past 100%).
func boundProgress(p *eitriv1.Progress) {
	if p == nil {
		return
	}
	p.Step = clip(p.GetStep(), maxAgentWord)
	if p.TotalBytes != nil && p.GetDoneBytes() > p.GetTotalBytes() {
		p.TotalBytes = nil
	}
}
