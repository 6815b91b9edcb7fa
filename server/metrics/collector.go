package metrics

import (
	"context"
	"errors"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
)

var (
	vmLabels   = []string{"vm", "name", "host", "owner"}
	hostLabels = []string{"host", "name"}
)

func vmDesc(name, help string) *prometheus.Desc {
	return prometheus.NewDesc("eitri_vm_"+name, help, vmLabels, nil)
}

func hostDesc(name, help string) *prometheus.Desc {
	return prometheus.NewDesc("eitri_host_"+name, help, hostLabels, nil)
}

var portLabels = []string{"exposure", "vm", "host", "protocol"}

func portDesc(name, help string, extra []string) *prometheus.Desc {
	return prometheus.NewDesc("eitri_published_port_"+name, help, append(append([]string{}, portLabels...), extra...), nil)
}

var (
	vmCPU         = vmDesc("cpu_seconds_total", "CPU time the VM's QEMU process used (user and system), since it started.")
	vmRSS         = vmDesc("memory_resident_bytes", "Resident memory of the VM's QEMU process.")
	vmBalloon     = vmDesc("memory_balloon_bytes", "The guest's memory as its balloon device sees it.")
	vmDiskRead    = vmDesc("disk_read_bytes_total", "Bytes the VM read from its block devices.")
	vmDiskWritten = vmDesc("disk_written_bytes_total", "Bytes the VM wrote to its block devices.")
	vmDiskReads   = vmDesc("disk_reads_total", "Read operations on the VM's block devices.")
	vmDiskWrites  = vmDesc("disk_writes_total", "Write operations on the VM's block devices.")
	vmNetRx       = vmDesc("network_receive_bytes_total", "Bytes the VM received on its network device.")
	vmNetTx       = vmDesc("network_transmit_bytes_total", "Bytes the VM sent on its network device.")
	vmNetRxPkts   = vmDesc("network_receive_packets_total", "Packets the VM received.")
	vmNetTxPkts   = vmDesc("network_transmit_packets_total", "Packets the VM sent.")
	vmNetRxDrops  = vmDesc("network_receive_drops_total", "Packets on their way to the VM that its tap dropped.")
	vmNetTxDrops  = vmDesc("network_transmit_drops_total", "Packets from the VM that its tap dropped.")
	vmVCPUs       = vmDesc("vcpus", "vCPUs the VM was given.")
	vmMemory      = vmDesc("memory_bytes", "Memory the VM was given.")

	hostCPU       = hostDesc("cpu_busy_seconds_total", "Time all of the host's CPUs spent busy, since boot.")
	hostCPUs      = hostDesc("cpus", "CPUs the host has.")
	hostMemTotal  = hostDesc("memory_total_bytes", "The host's memory.")
	hostMemAvail  = hostDesc("memory_available_bytes", "Memory the host can hand out without swapping.")
	hostFSSize    = hostDesc("filesystem_size_bytes", "Size of the filesystem holding the agent's images and disks.")
	hostFSFree    = hostDesc("filesystem_free_bytes", "Free space on that filesystem.")
	hostNetRx     = hostDesc("network_receive_bytes_total", "Bytes the host's own interfaces received.")
	hostNetTx     = hostDesc("network_transmit_bytes_total", "Bytes the host's own interfaces sent.")
	hostNetRxPkts = hostDesc("network_receive_packets_total", "Packets the host's own interfaces received.")
	hostNetTxPkts = hostDesc("network_transmit_packets_total", "Packets the host's own interfaces sent.")
	hostLoad1     = hostDesc("load1", "The host's 1-minute load average.")
	hostLoad5     = hostDesc("load5", "The host's 5-minute load average.")
	hostLoad15    = hostDesc("load15", "The host's 15-minute load average.")
	hostConnected = hostDesc("connected", "1 while the host's agent has a stream open, else 0.")
	hostCapVCPUs  = hostDesc("capacity_vcpus", "vCPUs the host offers guests.")
	hostCapMem    = hostDesc("capacity_memory_bytes", "Memory the host offers guests.")
	hostCapDisk   = hostDesc("capacity_disk_bytes", "Disk the host offers guests.")
	hostAllVCPUs  = hostDesc("allocated_vcpus", "vCPUs of the VMs placed on the host.")
	hostAllMem    = hostDesc("allocated_memory_bytes", "Memory of the VMs placed on the host.")
	hostAllDisk   = hostDesc("allocated_disk_bytes", "Disk of the VMs placed on the host.")

	// Published ports: labelled by the exposure's id and what it belongs to;
	// never by caller addresses, which are unbounded.
	portSessions = portDesc("sessions", "Conversations a published port holds right now (open TCP connections, live UDP sessions).", nil)
	portRefused  = portDesc("refused_total", "Callers a published port turned away at its cap, since its host's agent started.", nil)
	portDropped  = portDesc("dropped_total", "Conversations a published port could not carry to its guest, since its host's agent started.", nil)
	portBytes    = portDesc("bytes_total", "Payload bytes a published port carried, since its host's agent started: in is callers to the guest, out the guest to callers.", []string{"direction"})

	watcherCount = prometheus.NewDesc("eitri_watchers", "Watch streams open on this control plane, by what they watch.", []string{"stream"}, nil)
	scrapeErrors = prometheus.NewDesc("eitri_scrape_errors", "1 when part of this scrape could not be read (see the control plane's log).", []string{"part"}, nil)
)

// collector reads everything once per scrape.
type collector struct {
	ctx      context.Context
	fleet    Fleet
	usage    Usage
	watchers func() map[string]int
	now      time.Time
	log      *slog.Logger
}

// Describe sends nothing: the collector is unchecked, since which series
// exist depends on the fleet at scrape time.
func (c *collector) Describe(chan<- *prometheus.Desc) {}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	vms, vmErr := c.fleet.ListVMs(c.ctx)
	hosts, hostErr := c.fleet.ListHosts(c.ctx)
	ports, portErr := c.fleet.ListExposures(c.ctx, "")
	for part, err := range map[string]error{"vms": vmErr, "hosts": hostErr, "exposures": portErr} {
		v := 0.0
		if err != nil {
			v = 1
			if !errors.Is(err, context.Canceled) {
				c.log.Warn("metrics scrape", "part", part, "err", err)
			}
		}
		ch <- prometheus.MustNewConstMetric(scrapeErrors, prometheus.GaugeValue, v, part)
	}
	if p, ok := auth.FromContext(c.ctx); ok && p.Admin && c.watchers != nil {
		for stream, n := range c.watchers() {
			gauge(ch, watcherCount, float64(n), []string{stream})
		}
	}
	hostNames := make(map[string]string, len(hosts))
	for _, h := range hosts {
		hostNames[h.GetId()] = h.GetName()
		c.host(ch, h)
	}
	visible := make(map[string]*eitriv1.VM, len(vms))
	for _, v := range vms {
		if v.GetDeleted() {
			continue
		}
		visible[v.GetId()] = v
		l := []string{v.GetId(), v.GetName(), v.GetHostId(), v.GetOwnerId()}
		gauge(ch, vmVCPUs, float64(v.GetVcpus()), l)
		gauge(ch, vmMemory, float64(v.GetMemMb())*(1<<20), l)
	}
	for _, e := range ports {
		// ListExposures already holds to the caller's VMs; a port of a VM
		// this scrape does not serve (deleted) is left out with it.
		if _, ok := visible[e.GetVmId()]; ok {
			c.port(ch, e)
		}
	}
	vmUse, hostUse := c.usage.Latest()
	for _, s := range vmUse {
		u := s.Usage
		v, ok := visible[u.GetVmId()]
		// Only the VMs the caller may see, and only what their current
		// host measured lately.
		if !ok || v.GetHostId() != u.GetHostId() || c.now.Sub(u.GetAt().AsTime()) > Fresh {
			continue
		}
		c.vmUsage(ch, u, []string{v.GetId(), v.GetName(), v.GetHostId(), v.GetOwnerId()})
	}
	for _, u := range hostUse {
		name, ok := hostNames[u.GetHostId()]
		if !ok || c.now.Sub(u.GetAt().AsTime()) > Fresh {
			continue
		}
		c.hostUsage(ch, u, []string{u.GetHostId(), name})
	}
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels []string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
}

func counter(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels []string) {
	ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
}

// Unset figures (not measured) are left out, never served as 0.
func (c *collector) vmUsage(ch chan<- prometheus.Metric, u *eitriv1.VMUsage, l []string) {
	if u.CpuSeconds != nil {
		counter(ch, vmCPU, u.GetCpuSeconds(), l)
	}
	if u.MemoryRssBytes != nil {
		gauge(ch, vmRSS, float64(u.GetMemoryRssBytes()), l)
	}
	if u.MemoryBalloonBytes != nil {
		gauge(ch, vmBalloon, float64(u.GetMemoryBalloonBytes()), l)
	}
	if d := u.GetDisk(); d != nil {
		counter(ch, vmDiskRead, float64(d.GetReadBytes()), l)
		counter(ch, vmDiskWritten, float64(d.GetWriteBytes()), l)
		counter(ch, vmDiskReads, float64(d.GetReadOps()), l)
		counter(ch, vmDiskWrites, float64(d.GetWriteOps()), l)
	}
	if n := u.GetNet(); n != nil {
		counter(ch, vmNetRx, float64(n.GetReceivedBytes()), l)
		counter(ch, vmNetTx, float64(n.GetSentBytes()), l)
		counter(ch, vmNetRxPkts, float64(n.GetReceivedPackets()), l)
		counter(ch, vmNetTxPkts, float64(n.GetSentPackets()), l)
		counter(ch, vmNetRxDrops, float64(n.GetReceivedDropped()), l)
		counter(ch, vmNetTxDrops, float64(n.GetSentDropped()), l)
	}
}

func (c *collector) host(ch chan<- prometheus.Metric, h *eitriv1.Host) {
	l := []string{h.GetId(), h.GetName()}
	conn := 0.0
	if h.GetConnected() {
		conn = 1
	}
	gauge(ch, hostConnected, conn, l)
	if cp := h.GetCapacity(); cp != nil {
		gauge(ch, hostCapVCPUs, float64(cp.GetVcpus()), l)
		gauge(ch, hostCapMem, float64(cp.GetMemMb())*(1<<20), l)
		gauge(ch, hostCapDisk, float64(cp.GetDiskGb())*(1<<30), l)
	}
	if a := h.GetAllocated(); a != nil {
		gauge(ch, hostAllVCPUs, float64(a.GetVcpus()), l)
		gauge(ch, hostAllMem, float64(a.GetMemMb())*(1<<20), l)
		gauge(ch, hostAllDisk, float64(a.GetDiskGb())*(1<<30), l)
	}
}

func (c *collector) hostUsage(ch chan<- prometheus.Metric, u *eitriv1.HostUsage, l []string) {
	if u.CpuBusySeconds != nil {
		counter(ch, hostCPU, u.GetCpuBusySeconds(), l)
	}
	if u.GetCpus() > 0 {
		gauge(ch, hostCPUs, float64(u.GetCpus()), l)
	}
	if u.MemoryTotalBytes != nil {
		gauge(ch, hostMemTotal, float64(u.GetMemoryTotalBytes()), l)
	}
	if u.MemoryAvailableBytes != nil {
		gauge(ch, hostMemAvail, float64(u.GetMemoryAvailableBytes()), l)
	}
	if u.FilesystemTotalBytes != nil {
		gauge(ch, hostFSSize, float64(u.GetFilesystemTotalBytes()), l)
	}
	if u.FilesystemFreeBytes != nil {
		gauge(ch, hostFSFree, float64(u.GetFilesystemFreeBytes()), l)
	}
	if n := u.GetNet(); n != nil {
		counter(ch, hostNetRx, float64(n.GetReceivedBytes()), l)
		counter(ch, hostNetTx, float64(n.GetSentBytes()), l)
		counter(ch, hostNetRxPkts, float64(n.GetReceivedPackets()), l)
		counter(ch, hostNetTxPkts, float64(n.GetSentPackets()), l)
	}
	if ld := u.GetLoad(); ld != nil {
		gauge(ch, hostLoad1, ld.GetLoad1(), l)
		gauge(ch, hostLoad5, ld.GetLoad5(), l)
		gauge(ch, hostLoad15, ld.GetLoad15(), l)
	}
}

// port serves what the port's host counted. A port its host has not counted
// (pending, or an agent that does not count) has no series, and its bytes
// none until the agent counts bytes: never 0 for silence.
func (c *collector) port(ch chan<- prometheus.Metric, e *eitriv1.Exposure) {
	s := e.GetSessions()
	if s == nil {
		return
	}
	l := []string{e.GetId(), e.GetVmId(), e.GetHostId(), e.GetProtocol()}
	gauge(ch, portSessions, float64(s.GetActive()), l)
	counter(ch, portRefused, float64(s.GetRefused()), l)
	counter(ch, portDropped, float64(s.GetDropped()), l)
	if b := s.GetCarried(); b != nil {
		fixed := l[:len(l):len(l)] // each append copies, so neither sees the other's direction
		counter(ch, portBytes, float64(b.GetIn()), append(fixed, "in"))
		counter(ch, portBytes, float64(b.GetOut()), append(fixed, "out"))
	}
}
