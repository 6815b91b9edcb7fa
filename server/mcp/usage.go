package mcp

import (
	"context"
	"time"

	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// VMUsageIn names the VM and how far back to look.
type VMUsageIn struct {
	ID      string `json:"id" jsonschema:"the VM's id, e.g. vm-k3j5x7q2m4n6p2r5 (vm_list shows them)"`
	Minutes int    `json:"minutes,omitempty" jsonschema:"how many of the last minutes to return: 0 or unset is 10, at most 60"`
}

// UsagePoint is one sample of a VM, with the rates since the one before.
// A figure the host could not measure is null, never 0.
type UsagePoint struct {
	At                        string   `json:"at" jsonschema:"RFC 3339, by the host's clock"`
	CPUPercent                *float64 `json:"cpu_percent" jsonschema:"CPU used since the sample before, in percent of one CPU (200 is two CPUs busy); null for the first sample or when not measured"`
	CPUSeconds                *float64 `json:"cpu_seconds" jsonschema:"CPU time of the VM's QEMU since it started"`
	MemoryRSSBytes            *uint64  `json:"memory_rss_bytes" jsonschema:"resident memory of the VM's QEMU"`
	DiskReadBytesPerSecond    *float64 `json:"disk_read_bytes_per_second"`
	DiskWriteBytesPerSecond   *float64 `json:"disk_write_bytes_per_second"`
	NetReceivedBytesPerSecond *float64 `json:"net_received_bytes_per_second"`
	NetSentBytesPerSecond     *float64 `json:"net_sent_bytes_per_second"`
}

// VMUsageOut is a VM's recent usage, oldest first.
type VMUsageOut struct {
	VMID    string       `json:"vm_id"`
	HostID  string       `json:"host_id,omitempty" jsonschema:"the host that measured the newest sample"`
	Samples []UsagePoint `json:"samples" jsonschema:"about one every 10 seconds while the VM runs; empty for a VM that has not run lately"`
}

const maxUsageMinutes = 60

func (t *tools) registerUsage(s *mcp.Server) {
	addTool(t, s, &mcp.Tool{
		Name: "vm_usage",
		Description: "A VM's recent usage as its host measured it from outside the guest: CPU, resident memory, " +
			"disk and network throughput, one sample about every 10 seconds, oldest first.",
		InputSchema: schemaFor[VMUsageIn](func(p map[string]*jsonschema.Schema) {
			idProp(p["id"], exampleVMID)
			between(p["minutes"], 0, maxUsageMinutes)
		}),
	}, t.vmUsage)
}

func (t *tools) vmUsage(ctx context.Context, _ *mcp.CallToolRequest, in VMUsageIn) (VMUsageOut, error) {
	w, win, err := t.f.WatchUsage(ctx, in.ID, "")
	if err != nil {
		return VMUsageOut{}, err
	}
	w.Close() // the window is all this needs
	minutes := in.Minutes
	if minutes <= 0 {
		minutes = 10
	}
	since := time.Now().Add(-time.Duration(min(minutes, maxUsageMinutes)) * time.Minute)
	out := VMUsageOut{VMID: in.ID, Samples: []UsagePoint{}}
	var prev *eitriv1.VMUsage
	for _, u := range win.GetVms() {
		if prev != nil && prev.GetHostId() != u.GetHostId() {
			prev = nil
		}
		if !u.GetAt().AsTime().Before(since) {
			out.Samples = append(out.Samples, usagePoint(prev, u))
			out.HostID = u.GetHostId()
		}
		prev = u
	}
	return out, nil
}

func usagePoint(prev, u *eitriv1.VMUsage) UsagePoint {
	p := UsagePoint{At: rfc3339(u.GetAt()), CPUSeconds: u.CpuSeconds, MemoryRSSBytes: u.MemoryRssBytes}
	if prev == nil {
		return p
	}
	dt := u.GetAt().AsTime().Sub(prev.GetAt().AsTime()).Seconds()
	per := func(a, b float64, ok bool) *float64 {
		if !ok || dt <= 0 || b < a { // a counter that went back: its QEMU restarted
			return nil
		}
		v := (b - a) / dt
		return &v
	}
	if c := per(prev.GetCpuSeconds(), u.GetCpuSeconds(), prev.CpuSeconds != nil && u.CpuSeconds != nil); c != nil {
		pc := *c * 100
		p.CPUPercent = &pc
	}
	pd, d := prev.GetDisk(), u.GetDisk()
	p.DiskReadBytesPerSecond = per(float64(pd.GetReadBytes()), float64(d.GetReadBytes()), pd != nil && d != nil)
	p.DiskWriteBytesPerSecond = per(float64(pd.GetWriteBytes()), float64(d.GetWriteBytes()), pd != nil && d != nil)
	pn, n := prev.GetNet(), u.GetNet()
	p.NetReceivedBytesPerSecond = per(float64(pn.GetReceivedBytes()), float64(n.GetReceivedBytes()), pn != nil && n != nil)
	p.NetSentBytesPerSecond = per(float64(pn.GetSentBytes()), float64(n.GetSentBytes()), pn != nil && n != nil)
	return p
}
