package agent

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/reconcile"
	"github.com/a73x/eitri/agent/usage"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// usageSampler measures the guests the engine reports running, each by
// its QEMU process, its tap and its QMP socket.
func usageSampler(dataDir string, eng *reconcile.Engine, qb *qemu.Backend) func(context.Context) *eitriv1.UsageSample {
	s := &usage.Sampler{
		DataDir: dataDir,
		Guests: func(context.Context) []usage.Guest {
			var out []usage.Guest
			for _, v := range eng.Report().GetVms() {
				if v.GetPower() != vmstate.PowerRunning {
					continue
				}
				pid, ok := qb.PID(v.GetVmId())
				if !ok {
					continue
				}
				out = append(out, usage.Guest{ID: v.GetVmId(), PID: pid, Tap: netsetup.TapName(v.GetVmId())})
			}
			return out
		},
		IO: func(ctx context.Context, id string) (usage.IO, error) {
			// A QEMU slow to answer costs its own figures, not the sample.
			ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			st, err := qb.IOStats(ctx, id)
			if err != nil {
				return usage.IO{}, err
			}
			d := st.Disk
			return usage.IO{Disk: usage.Disk{ReadBytes: d.ReadBytes, WriteBytes: d.WriteBytes, ReadOps: d.ReadOps, WriteOps: d.WriteOps},
				BalloonBytes: st.BalloonBytes}, nil
		},
	}
	return func(ctx context.Context) *eitriv1.UsageSample {
		host, vms := s.Sample(ctx)
		return usageSample(host, vms)
	}
}

// usageSample is the wire form of one round of measurements.
func usageSample(host usage.Host, vms []usage.VM) *eitriv1.UsageSample {
	out := &eitriv1.UsageSample{Host: &eitriv1.HostUsage{
		At: timestamppb.New(host.At), CpuBusySeconds: host.CPUBusySeconds, Cpus: int32(host.CPUs),
		MemoryTotalBytes: host.MemTotalBytes, MemoryAvailableBytes: host.MemAvailableBytes,
		FilesystemTotalBytes: host.FSTotalBytes, FilesystemFreeBytes: host.FSFreeBytes,
		// The host's own interfaces: what they received came in to it.
		Net: netUsage(host.Net, false),
	}}
	if host.Load1 != nil && host.Load5 != nil && host.Load15 != nil {
		out.Host.Load = &eitriv1.LoadAverage{Load1: *host.Load1, Load5: *host.Load5, Load15: *host.Load15}
	}
	for _, v := range vms {
		u := &eitriv1.VMUsage{VmId: v.ID, At: timestamppb.New(v.At), CpuSeconds: v.CPUSeconds,
			MemoryRssBytes: v.RSSBytes, MemoryBalloonBytes: v.BalloonBytes,
			// A tap receives what its guest sends.
			Net: netUsage(v.Net, true)}
		if d := v.Disk; d != nil {
			u.Disk = &eitriv1.DiskUsage{ReadBytes: d.ReadBytes, WriteBytes: d.WriteBytes, ReadOps: d.ReadOps, WriteOps: d.WriteOps}
		}
		out.Vms = append(out.Vms, u)
	}
	return out
}

// netUsage turns interface counters into what the VM or host saw; tap
// flips them, since a tap's rx is its guest's tx.
func netUsage(n *usage.Net, tap bool) *eitriv1.NetUsage {
	if n == nil {
		return nil
	}
	if tap {
		return &eitriv1.NetUsage{ReceivedBytes: n.TxBytes, SentBytes: n.RxBytes, ReceivedPackets: n.TxPackets, SentPackets: n.RxPackets,
			ReceivedDropped: n.TxDropped, SentDropped: n.RxDropped}
	}
	return &eitriv1.NetUsage{ReceivedBytes: n.RxBytes, SentBytes: n.TxBytes, ReceivedPackets: n.RxPackets, SentPackets: n.TxPackets,
		ReceivedDropped: n.RxDropped, SentDropped: n.TxDropped}
}
