package fleet

import (
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/intake"
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
	// maxAgentItems bounds each list a host sends (VMs, ports, images),
	// far above what one machine runs; maxAgentBytes each bytes field.
	maxAgentItems = 4096
	maxAgentBytes = 64 << 10
)

// clip cuts s to at most n bytes on a rune boundary, ending in "…".
func clip(s string, n int) string { return intake.Clip(s, n) }

// printable drops the control characters from an agent's text but
// newlines and tabs (see intake.Printable).
func printable(s string) string { return intake.Printable(s, true) }

// clipFront is clip for text whose end matters most (a console's last
// lines): it keeps the last n bytes, starting with "…".
func clipFront(s string, n int) string { return intake.ClipFront(s, n) }

// fromHost is the one rule for everything a host sends (see package
// intake): unknown fields dropped, every string bounded and stripped of
// control characters, every bytes and repeated field bounded. Fields not
// named here are short words: versions, names, addresses, ids, states.
var fromHost = intake.Rules{
	DefaultText:  intake.Text{Max: maxAgentShort},
	DefaultItems: maxAgentItems,
	DefaultBytes: maxAgentBytes,
	Text: map[protoreflect.FullName]intake.Text{
		"eitri.v1.Hello.accelerator_reason":             {Max: maxAgentLine, Lines: true},
		"eitri.v1.ActualStateReport.accelerator_reason": {Max: maxAgentLine, Lines: true},
		"eitri.v1.ActualVM.status_detail":               {Max: maxAgentLine, Lines: true},
		"eitri.v1.ActualVM.last_error":                  {Max: maxAgentError, Lines: true},
		"eitri.v1.ActualVM.ssh_host_pubkey":             {Max: maxAgentPubkey, Lines: true},
		"eitri.v1.GuestExit.reason":                     {Max: maxAgentLine, Lines: true},
		"eitri.v1.GuestExit.serial_tail":                {Max: maxAgentError, Lines: true, Tail: true},
		"eitri.v1.ExposureActual.reason":                {Max: maxAgentLine, Lines: true},
		"eitri.v1.SnapshotRefusal.reason":               {Max: maxAgentLine, Lines: true},
		"eitri.v1.AgentUpgradeStatus.step":              {Max: maxAgentWord},
		"eitri.v1.AgentUpgradeStatus.detail":            {Max: maxAgentLine, Lines: true},
		"eitri.v1.AgentUpgradeStatus.error":             {Max: maxAgentError, Lines: true},
		"eitri.v1.ImageHeld.sha256":                     {Max: 64},
		"eitri.v1.ImageHeld.status_detail":              {Max: maxAgentLine, Lines: true},
		"eitri.v1.ImageHeld.error":                      {Max: maxAgentError, Lines: true},
		"eitri.v1.CachedImage.sha256":                   {Max: 64},
		"eitri.v1.Progress.step":                        {Max: maxAgentWord},
	},
	Items: map[protoreflect.FullName]int{
		// Counted in "more" by ImageCache, which cuts them first.
		"eitri.v1.ImageCacheReport.images": maxCacheRows,
		"eitri.v1.CachedImage.vm_ids":      maxCacheRowVMs,
	},
}

// cleanFromHost applies fromHost to a message from a host (a Hello, a
// usage sample, an image-cache listing), in place.
func cleanFromHost(m proto.Message) { fromHost.Clean(m) }

// clipReport bounds and cleans a report in place, and drops a progress
// total it cannot believe.
func clipReport(r *eitriv1.ActualStateReport) {
	cleanFromHost(r)
	for _, v := range r.GetVms() {
		boundProgress(v.GetProgress())
	}
	boundProgress(r.GetUpgrade().GetProgress())
	for _, im := range r.GetImages() {
		boundProgress(im.GetProgress())
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
