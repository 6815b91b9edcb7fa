package cli

import (
	"context"
	"fmt"
	"io"
	"slices"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// topRefresh is how often a top table is drawn again; samples arrive every
// 10 s per host, spread over the interval.
const topRefresh = 2 * time.Second

func newVMTopCmd(a *app) *cobra.Command {
	var once bool
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Your VMs' CPU, memory, disk and network, live, busiest first",
		Args:  NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			names := map[string]string{}
			if r, err := c.vm.ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{})); err == nil {
				for _, v := range r.Msg.GetVms() {
					names[v.GetId()] = v.GetName()
				}
			}
			return c.top(ctx, &eitriv1.WatchUsageRequest{}, once, func(w io.Writer, u *usageSeries) {
				vmTopTable(w, names, u)
			})
		}),
	}
	cmd.Flags().BoolVar(&once, "once", false, "print the table once and exit")
	return cmd
}

func newHostTopCmd(a *app) *cobra.Command {
	var once bool
	cmd := &cobra.Command{
		Use:   "top",
		Short: "The hosts' CPU, memory, network and load, live, busiest first",
		Args:  NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			names := map[string]string{}
			if r, err := c.host.ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{})); err == nil {
				for _, h := range r.Msg.GetHosts() {
					names[h.GetId()] = h.GetName()
				}
			}
			return c.top(ctx, &eitriv1.WatchUsageRequest{}, once, func(w io.Writer, u *usageSeries) {
				hostTopTable(w, names, u)
			})
		}),
	}
	cmd.Flags().BoolVar(&once, "once", false, "print the table once and exit")
	return cmd
}

func newVMStatsCmd(a *app) *cobra.Command {
	var noFollow bool
	cmd := &cobra.Command{
		Use:   "stats NAME|ID",
		Short: "One VM's usage over the last hour, then each sample as it comes",
		Args:  needArgs("a VM name or id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			id, err := c.vmID(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			return c.vmStats(cmd.Context(), id, noFollow)
		},
	}
	cmd.Flags().BoolVar(&noFollow, "no-follow", false, "print what the control plane holds and exit")
	return cmd
}

// usageSeries keeps the last two samples of each VM and host: enough for
// a rate.
type usageSeries struct {
	vms   map[string][2]*eitriv1.VMUsage
	hosts map[string][2]*eitriv1.HostUsage
}

func newUsageSeries() *usageSeries {
	return &usageSeries{vms: map[string][2]*eitriv1.VMUsage{}, hosts: map[string][2]*eitriv1.HostUsage{}}
}

func (s *usageSeries) vm(u *eitriv1.VMUsage) {
	p := s.vms[u.GetVmId()]
	if p[1] != nil && p[1].GetHostId() != u.GetHostId() {
		p[1] = nil // another host's counters: no rate across them
	}
	s.vms[u.GetVmId()] = [2]*eitriv1.VMUsage{p[1], u}
}

func (s *usageSeries) host(u *eitriv1.HostUsage) {
	p := s.hosts[u.GetHostId()]
	s.hosts[u.GetHostId()] = [2]*eitriv1.HostUsage{p[1], u}
}

func (s *usageSeries) add(m *eitriv1.WatchUsageResponse) {
	if w := m.GetWindow(); w != nil {
		for _, u := range w.GetVms() {
			s.vm(u)
		}
		for _, u := range w.GetHosts() {
			s.host(u)
		}
	}
	if u := m.GetVm(); u != nil {
		s.vm(u)
	}
	if u := m.GetHost(); u != nil {
		s.host(u)
	}
}

// rate is the per-second change of a counter between two samples; ok is
// false when either did not measure it, the time did not move, or the
// counter went back (its QEMU restarted).
func rate(prev, cur float64, prevAt, curAt time.Time, ok bool) (float64, bool) {
	dt := curAt.Sub(prevAt).Seconds()
	if !ok || dt <= 0 || cur < prev {
		return 0, false
	}
	return (cur - prev) / dt, true
}

// vmRates are one VM's figures between its last two samples.
type vmRates struct {
	cpu                        float64 // percent of one CPU
	cpuOK                      bool
	rss                        *uint64
	diskR, diskW, netRx, netTx float64
	diskOK, netOK              bool
}

func vmRatesOf(p [2]*eitriv1.VMUsage) vmRates {
	prev, cur := p[0], p[1]
	r := vmRates{rss: cur.MemoryRssBytes}
	if prev == nil {
		return r
	}
	pa, ca := prev.GetAt().AsTime(), cur.GetAt().AsTime()
	r.cpu, r.cpuOK = rate(prev.GetCpuSeconds(), cur.GetCpuSeconds(), pa, ca, prev.CpuSeconds != nil && cur.CpuSeconds != nil)
	r.cpu *= 100
	pd, cd := prev.GetDisk(), cur.GetDisk()
	var okR, okW bool
	r.diskR, okR = rate(float64(pd.GetReadBytes()), float64(cd.GetReadBytes()), pa, ca, pd != nil && cd != nil)
	r.diskW, okW = rate(float64(pd.GetWriteBytes()), float64(cd.GetWriteBytes()), pa, ca, pd != nil && cd != nil)
	r.diskOK = okR && okW
	pn, cn := prev.GetNet(), cur.GetNet()
	r.netRx, okR = rate(float64(pn.GetReceivedBytes()), float64(cn.GetReceivedBytes()), pa, ca, pn != nil && cn != nil)
	r.netTx, okW = rate(float64(pn.GetSentBytes()), float64(cn.GetSentBytes()), pa, ca, pn != nil && cn != nil)
	r.netOK = okR && okW
	return r
}

func pct(v float64, ok bool) string {
	if !ok {
		return "—"
	}
	return fmt.Sprintf("%.1f%%", v)
}

func sizeOf(b *uint64) string {
	if b == nil {
		return "—"
	}
	return humanBytes(float64(*b))
}

func pairPerSec(a, b float64, ok bool) string {
	if !ok {
		return "—"
	}
	return humanBytes(a) + "/s / " + humanBytes(b) + "/s"
}

func humanBytes(b float64) string {
	units := []string{"B", "KiB", "MiB", "GiB", "TiB"}
	i := 0
	for b >= 1024 && i < len(units)-1 {
		b /= 1024
		i++
	}
	if i == 0 {
		return fmt.Sprintf("%.0f B", b)
	}
	return fmt.Sprintf("%.1f %s", b, units[i])
}

// vmTopTable lists the VMs busiest first (a VM with no CPU figure last).
func vmTopTable(w io.Writer, names map[string]string, s *usageSeries) {
	type row struct {
		id string
		r  vmRates
	}
	rows := make([]row, 0, len(s.vms))
	for id, p := range s.vms {
		rows = append(rows, row{id, vmRatesOf(p)})
	}
	slices.SortFunc(rows, func(a, b row) int {
		switch {
		case a.r.cpuOK != b.r.cpuOK:
			if a.r.cpuOK {
				return -1
			}
			return 1
		case a.r.cpu != b.r.cpu:
			if a.r.cpu > b.r.cpu {
				return -1
			}
			return 1
		}
		return compareStrings(a.id, b.id)
	})
	fmt.Fprintln(w, "ID\tNAME\tHOST\tCPU\tMEMORY\tDISK R/W\tNET IN/OUT")
	for _, r := range rows {
		cur := s.vms[r.id][1]
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.id, dash(names[r.id]), cur.GetHostId(), pct(r.r.cpu, r.r.cpuOK),
			sizeOf(r.r.rss), pairPerSec(r.r.diskR, r.r.diskW, r.r.diskOK), pairPerSec(r.r.netRx, r.r.netTx, r.r.netOK))
	}
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// hostRates are one host's figures between its last two samples.
type hostRates struct {
	cpu          float64 // percent of all its CPUs
	cpuOK        bool
	netRx, netTx float64
	netOK        bool
}

func hostRatesOf(p [2]*eitriv1.HostUsage) hostRates {
	prev, cur := p[0], p[1]
	var r hostRates
	if prev == nil {
		return r
	}
	pa, ca := prev.GetAt().AsTime(), cur.GetAt().AsTime()
	r.cpu, r.cpuOK = rate(prev.GetCpuBusySeconds(), cur.GetCpuBusySeconds(), pa, ca,
		prev.CpuBusySeconds != nil && cur.CpuBusySeconds != nil && cur.GetCpus() > 0)
	if r.cpuOK {
		r.cpu = r.cpu * 100 / float64(cur.GetCpus())
	}
	pn, cn := prev.GetNet(), cur.GetNet()
	var okR, okT bool
	r.netRx, okR = rate(float64(pn.GetReceivedBytes()), float64(cn.GetReceivedBytes()), pa, ca, pn != nil && cn != nil)
	r.netTx, okT = rate(float64(pn.GetSentBytes()), float64(cn.GetSentBytes()), pa, ca, pn != nil && cn != nil)
	r.netOK = okR && okT
	return r
}

func hostTopTable(w io.Writer, names map[string]string, s *usageSeries) {
	type row struct {
		id string
		r  hostRates
	}
	rows := make([]row, 0, len(s.hosts))
	for id, p := range s.hosts {
		rows = append(rows, row{id, hostRatesOf(p)})
	}
	slices.SortFunc(rows, func(a, b row) int {
		if a.r.cpuOK != b.r.cpuOK {
			if a.r.cpuOK {
				return -1
			}
			return 1
		}
		if a.r.cpu != b.r.cpu {
			if a.r.cpu > b.r.cpu {
				return -1
			}
			return 1
		}
		return compareStrings(a.id, b.id)
	})
	fmt.Fprintln(w, "ID\tNAME\tCPU\tMEMORY USED\tLOAD\tNET IN/OUT")
	for _, r := range rows {
		cur := s.hosts[r.id][1]
		mem := "—"
		if cur.MemoryTotalBytes != nil && cur.MemoryAvailableBytes != nil {
			mem = humanBytes(float64(cur.GetMemoryTotalBytes()-min(cur.GetMemoryAvailableBytes(), cur.GetMemoryTotalBytes()))) +
				" of " + humanBytes(float64(cur.GetMemoryTotalBytes()))
		}
		load := "—"
		if l := cur.GetLoad(); l != nil {
			load = fmt.Sprintf("%.2f %.2f %.2f", l.GetLoad1(), l.GetLoad5(), l.GetLoad15())
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", r.id, dash(names[r.id]), pct(r.r.cpu, r.r.cpuOK), mem, load,
			pairPerSec(r.r.netRx, r.r.netTx, r.r.netOK))
	}
}

// top follows the usage stream and draws the table every topRefresh
// (cleared in place on a terminal); once draws it from the window alone.
func (c *client) top(ctx context.Context, req *eitriv1.WatchUsageRequest, once bool, table func(io.Writer, *usageSeries)) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.usage.WatchUsage(ctx, connect.NewRequest(req))
	if err != nil {
		return apiError(err)
	}
	defer st.Close()
	msgs := make(chan *eitriv1.WatchUsageResponse)
	done := make(chan error, 1)
	go func() {
		for st.Receive() {
			select {
			case msgs <- st.Msg():
			case <-ctx.Done():
				return
			}
		}
		done <- st.Err()
	}()
	s := newUsageSeries()
	draw := func() {
		if c.tty && !once {
			fmt.Fprint(c.out, "\x1b[H\x1b[2J") // home and clear: a table in place
		}
		tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
		table(tw, s)
		_ = tw.Flush()
		if !c.tty && !once {
			fmt.Fprintln(c.out)
		}
	}
	tick := time.NewTicker(topRefresh)
	defer tick.Stop()
	drawn := false
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-done:
			if ctx.Err() != nil {
				return nil
			}
			return apiError(err)
		case m := <-msgs:
			s.add(m)
			if m.GetWindow() != nil && (once || !drawn) {
				draw()
				drawn = true
				if once {
					return nil
				}
			}
		case <-tick.C:
			draw()
		}
	}
}

// statsLine lays out vm stats by fixed widths, not a tabwriter: lines go
// out as samples arrive, so no later line can widen a column. The widths
// hold the widest figure each column prints ("1023.9 KiB/s / 1023.9 KiB/s").
const statsLine = "%-8s  %7s  %10s  %-27s  %s\n"

// vmStats prints one line per sample of one VM: the window, then each new
// one.
func (c *client) vmStats(ctx context.Context, id string, noFollow bool) error {
	st, err := c.usage.WatchUsage(ctx, connect.NewRequest(&eitriv1.WatchUsageRequest{VmId: id}))
	if err != nil {
		return apiError(err)
	}
	defer st.Close()
	var last *eitriv1.VMUsage
	line := func(u *eitriv1.VMUsage) {
		p := [2]*eitriv1.VMUsage{last, u}
		if last != nil && last.GetHostId() != u.GetHostId() {
			p[0] = nil
		}
		r := vmRatesOf(p)
		fmt.Fprintf(c.out, statsLine, u.GetAt().AsTime().Local().Format(time.TimeOnly), pct(r.cpu, r.cpuOK),
			sizeOf(r.rss), pairPerSec(r.diskR, r.diskW, r.diskOK), pairPerSec(r.netRx, r.netTx, r.netOK))
		last = u
	}
	for st.Receive() {
		m := st.Msg()
		if c.format != formatTable {
			b, err := encode(m, c.format, false)
			if err != nil {
				return err
			}
			_, _ = c.out.Write(b)
		} else if w := m.GetWindow(); w != nil {
			fmt.Fprintf(c.out, statsLine, "TIME", "CPU", "MEMORY", "DISK R/W", "NET IN/OUT")
			for _, u := range w.GetVms() {
				line(u)
			}
		} else if u := m.GetVm(); u != nil {
			line(u)
		}
		if noFollow && m.GetWindow() != nil {
			return nil
		}
	}
	if ctx.Err() != nil {
		return nil
	}
	return apiError(st.Err())
}
