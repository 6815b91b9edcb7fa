package cli

import (
	"fmt"
	"io"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// statusLine is what a person reads beside the lifecycle: the host's
// sentence while creating, the error when failed, nothing when settled.
func statusLine(v *eitriv1.VM) string {
	switch {
	case vmstate.Narrated(v.Lifecycle) && v.StatusDetail != "":
		return v.StatusDetail
	case v.Lifecycle == vmstate.LifecycleFailed, v.Lifecycle == vmstate.LifecycleLost:
		return v.LastError
	case v.Deleted && v.RestorableUntil != nil:
		if time.Now().Before(v.RestorableUntil.AsTime()) {
			return "restorable until " + when(v.RestorableUntil.AsTime())
		}
		return "destroyed at " + when(v.DestroyAt.AsTime())
	}
	return ""
}

// orphanTable lists VMs hosts hold without this control plane's trust in
// its record of them, with what the host recorded and why it holds them.
func orphanTable(w io.Writer, vms ...*eitriv1.OrphanedVM) {
	fmt.Fprintln(w, "HOST\tID\tNAME\tOWNER\tSIZE\tPOWER\tROW HERE\tSINCE\tWHY")
	for _, o := range vms {
		owner := o.OwnerId
		if o.OwnerName != "" {
			owner = o.OwnerName + " (" + o.OwnerId + ")"
		} else if owner != "" {
			owner += " (unknown here)"
		}
		power := dash(o.ActualPower) + " (held " + dash(o.PowerState) + ")"
		if o.Deleted {
			power += ", deleted"
		}
		row := "none"
		if o.HasRow {
			row = "older"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%dc/%dM/%dG\t%s\t%s\t%s\t%s\n", o.HostId, o.VmId, o.Name, dash(owner), o.Vcpus, o.MemMb, o.DiskGb,
			power, row, whenPB(o.Since, "—"), o.Reason)
	}
}

func vmTable(w io.Writer, vms ...*eitriv1.VM) {
	fmt.Fprintln(w, "ID\tNAME\tHOST\tSIZE\tSTATUS\tPOWER\tADDRESS\t")
	for _, v := range vms {
		fmt.Fprintf(w, "%s\t%s\t%s\t%dc/%dM/%dG\t%s\t%s\t%s\t%s\n", v.Id, v.Name, v.HostId, v.Vcpus, v.MemMb, v.DiskGb,
			v.Lifecycle, dash(v.ActualPower), dash(v.AssignedIp), statusLine(v))
	}
}

func vmDetail(w io.Writer, v *eitriv1.VM) {
	rows := [][2]string{
		{"id", v.Id}, {"name", v.Name}, {"host", v.HostId}, {"status", v.Lifecycle + " " + statusLine(v)},
		{"power", dash(v.ActualPower) + " (desired " + v.PowerState + ")"}, {"address", dash(v.AssignedIp) + " (host-local NAT)"},
		{"size", fmt.Sprintf("%d vCPU, %d MiB, %d GiB", v.Vcpus, v.MemMb, v.DiskGb)}, {"image", vmImage(v)},
		{"sha256", v.ImageSha256}, {"created", when(v.CreatedAt.AsTime())},
	}
	if len(v.TrustedCas) > 0 {
		var cas []string
		for _, ca := range v.TrustedCas {
			word := "rotated out"
			if ca.Current {
				word = "current"
			}
			cas = append(cas, ca.Fingerprint+" ("+word+")")
		}
		rows = append(rows, [2]string{"trusts user CAs", strings.Join(cas, ", ")})
	}
	if v.TrustStale {
		rows = append(rows, [2]string{"ssh", "STALE: " + v.TrustFix})
	}
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\n", r[0], r[1])
	}
}

func hostTable(w io.Writer, hosts ...*eitriv1.Host) {
	fmt.Fprintln(w, "ID\tNAME\tCONNECTED\tACCEL\tADDRESS\tCPU\tMEMORY\tDISK\tVERSION\tNOTES")
	for _, h := range hosts {
		use := func(a, c int64) string {
			if h.Capacity == nil {
				return fmt.Sprintf("%d/?", a)
			}
			return fmt.Sprintf("%d/%d", a, c)
		}
		fmt.Fprintf(w, "%s\t%s\t%v\t%s\t%s\t%s\t%s MiB\t%s GiB\t%s\t%s\n", h.Id, h.Name, h.Connected, dash(h.Accelerator), dash(h.Address),
			use(int64(h.Allocated.GetVcpus()), int64(h.Capacity.GetVcpus())), use(h.Allocated.GetMemMb(), h.Capacity.GetMemMb()),
			use(h.Allocated.GetDiskGb(), h.Capacity.GetDiskGb()), dash(h.AgentVersion), hostNotes(h))
	}
}

// hostNotes is what a person should know about a host beyond the numbers:
// its ongoing problems first, then why it runs under its accelerator.
func hostNotes(h *eitriv1.Host) string {
	var notes []string
	if !h.Connected {
		notes = append(notes, "offline")
	}
	for _, c := range h.Conditions {
		if c.Type == "upgrade_stuck" {
			notes = append(notes, c.Message) // it says "stuck: …" itself
			continue
		}
		notes = append(notes, strings.ToUpper(strings.ReplaceAll(c.Type, "_", " "))+": "+c.Message)
	}
	if u := h.Upgrade; u != nil && !u.Stuck {
		switch {
		case u.Step == "failed":
			notes = append(notes, "upgrade to "+u.Target+" failed: "+u.Error)
		case u.Step != "done" && u.Detail != "":
			notes = append(notes, "upgrading to "+u.Target+": "+u.Detail)
		case u.Step != "done":
			notes = append(notes, "upgrading to "+u.Target+": "+u.Step)
		}
	}
	if h.AgentUpdateAvailable {
		notes = append(notes, "agent update available")
	}
	if h.AcceleratorReason != "" {
		notes = append(notes, h.AcceleratorReason)
	}
	return strings.Join(notes, "; ")
}

func exposureTable(w io.Writer, exps ...*eitriv1.Exposure) {
	fmt.Fprintln(w, "ID\tVM\tPUBLISHED\tGUEST\tSTATE\tIN\tOUT\tSESSIONS")
	for _, e := range exps {
		addr := e.HostAddr
		if strings.Contains(addr, ":") {
			addr = "[" + addr + "]"
		}
		state := e.State
		if e.Reason != "" {
			state += " (" + e.Reason + ")"
		}
		in, out := carried(e.Sessions.GetCarried())
		fmt.Fprintf(w, "%s\t%s\t%s:%d/%s\t%d\t%s\t%s\t%s\t%s\n", e.Id, e.VmId, dash(addr), e.HostPort, e.Protocol, e.GuestPort, state,
			in, out, sessions(e.Sessions))
	}
}

// carried words the bytes a published port moved each way, or dashes when
// its host did not count them: null is never shown as zero.
func carried(b *eitriv1.ExposureBytes) (in, out string) {
	if b == nil {
		return "—", "—"
	}
	return humanBytes(float64(b.In)), humanBytes(float64(b.Out))
}

// sessions words an exposure's counters, or a dash when its host did not
// count: null is never shown as zeros.
func sessions(s *eitriv1.ExposureSessions) string {
	if s == nil {
		return "—"
	}
	return fmt.Sprintf("%d open · %d refused, %d dropped since agent start", s.Active, s.Refused, s.Dropped)
}

func dash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}

func when(t time.Time) string { return t.Local().Format(time.DateTime) }

func whenPB(t *timestamppb.Timestamp, none string) string {
	if t == nil {
		return none
	}
	return when(t.AsTime())
}

func eventTable(w io.Writer, events ...*eitriv1.VMEvent) {
	for _, e := range events {
		// An exit's message carries console lines: they go under it,
		// indented, not into the table.
		first, rest, _ := strings.Cut(e.Message, "\n")
		fmt.Fprintf(w, "%s\t%s\t%s\n", when(e.At.AsTime()), e.Kind, first)
		if rest != "" {
			fmt.Fprintf(w, "\t\t  %s\n", strings.ReplaceAll(rest, "\n", "\n\t\t  "))
		}
	}
}

// vmImage is the catalogue name and version a VM was made from, with its
// URL; the URL alone for an ad-hoc image.
func vmImage(v *eitriv1.VM) string {
	if v.ImageName == "" {
		return v.ImageUrl
	}
	return fmt.Sprintf("%s version %d (%s)", v.ImageName, v.ImageVersion, v.ImageUrl)
}
