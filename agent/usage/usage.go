// Package usage measures, from the host alone, what each guest and the host
// itself use: CPU time and resident memory of each guest's QEMU process
// (/proc), its disk traffic and balloon (from QEMU, through a function the
// caller gives), its tap's network counters (/sys/class/net), and the
// host's CPU, memory, filesystem, network and load. Nothing runs in the
// guest.
//
// A figure that could not be read is nil, never 0: a guest whose QEMU did
// not answer has no disk figures, not zero traffic.
package usage

import (
	"context"
	"os"
	"path/filepath"
	"time"
)

// userHZ is the unit of the CPU times in /proc/PID/stat and /proc/stat.
// The kernel fixes it at 100 for userspace whatever its internal tick.
const userHZ = 100

// Guest is one running guest to measure.
type Guest struct {
	ID  string
	PID int
	// Tap is the guest's network device on the host; "" when it has none.
	Tap string
}

// Disk is block traffic since the guest's QEMU started.
type Disk struct {
	ReadBytes, WriteBytes, ReadOps, WriteOps uint64
}

// IO is what the hypervisor says of one guest (see Sampler.IO).
type IO struct {
	Disk         Disk
	BalloonBytes *uint64
}

// Net is one interface's counters as the host's side of it counts them. On
// a guest's tap, Rx is what the guest sent and Tx what it received.
type Net struct {
	RxBytes, TxBytes     uint64
	RxPackets, TxPackets uint64
	RxDropped, TxDropped uint64
}

// VM is one sample of one guest.
type VM struct {
	ID string
	At time.Time
	// CPUSeconds is user plus system time of the guest's QEMU process.
	CPUSeconds *float64
	// RSSBytes is the QEMU process's resident memory.
	RSSBytes     *uint64
	BalloonBytes *uint64
	Disk         *Disk
	Net          *Net
}

// Host is one sample of the host.
type Host struct {
	At time.Time
	// CPUBusySeconds is the time all CPUs spent not idle (user, nice,
	// system, irq, softirq, steal); CPUs is how many there are.
	CPUBusySeconds *float64
	CPUs           int
	MemTotalBytes  *uint64
	// MemAvailableBytes is what the kernel estimates can be given out
	// without swapping (MemAvailable).
	MemAvailableBytes *uint64
	// FSTotalBytes and FSFreeBytes are the data directory's filesystem.
	FSTotalBytes, FSFreeBytes *uint64
	// Net sums the host's own interfaces: not loopback, bridges or taps.
	Net    *Net
	Load1  *float64
	Load5  *float64
	Load15 *float64
}

// Sampler reads the figures. The zero value is not usable: set at least
// Guests.
type Sampler struct {
	// Proc and Sys are where procfs and sysfs are mounted ("/proc",
	// "/sys" when empty); tests point them at trees of their own.
	Proc, Sys string
	// DataDir is the filesystem whose space the host sample reports; ""
	// reports none.
	DataDir string
	// Guests lists the guests running now.
	Guests func(context.Context) []Guest
	// IO asks the hypervisor for a guest's disk and balloon figures; nil,
	// or an error, leaves them unsaid.
	IO func(ctx context.Context, id string) (IO, error)
	// Now is the clock (time.Now when nil).
	Now func() time.Time
}

func (s *Sampler) proc() string {
	if s.Proc == "" {
		return "/proc"
	}
	return s.Proc
}

func (s *Sampler) sys() string {
	if s.Sys == "" {
		return "/sys"
	}
	return s.Sys
}

func (s *Sampler) now() time.Time {
	if s.Now == nil {
		return time.Now()
	}
	return s.Now()
}

// Sample measures the host and every running guest once.
func (s *Sampler) Sample(ctx context.Context) (Host, []VM) {
	host := s.host()
	guests := s.Guests(ctx)
	vms := make([]VM, 0, len(guests))
	for _, g := range guests {
		if ctx.Err() != nil {
			break
		}
		vms = append(vms, s.vm(ctx, g))
	}
	return host, vms
}

func (s *Sampler) vm(ctx context.Context, g Guest) VM {
	v := VM{ID: g.ID, At: s.now()}
	if g.PID > 0 {
		pdir := filepath.Join(s.proc(), itoa(g.PID))
		v.CPUSeconds = processCPU(pdir)
		v.RSSBytes = processRSS(pdir)
	}
	if s.IO != nil {
		if io, err := s.IO(ctx, g.ID); err == nil {
			d := io.Disk
			v.Disk, v.BalloonBytes = &d, io.BalloonBytes
		}
	}
	if g.Tap != "" {
		v.Net = ifaceCounters(filepath.Join(s.sys(), "class", "net", g.Tap))
	}
	return v
}

func (s *Sampler) host() Host {
	h := Host{At: s.now()}
	h.CPUBusySeconds, h.CPUs = hostCPU(s.proc())
	h.MemTotalBytes, h.MemAvailableBytes = hostMemory(s.proc())
	h.Load1, h.Load5, h.Load15 = hostLoad(s.proc())
	if s.DataDir != "" {
		h.FSTotalBytes, h.FSFreeBytes = filesystem(s.DataDir)
	}
	h.Net = hostNet(filepath.Join(s.sys(), "class", "net"))
	return h
}

// readSmall reads a small proc or sys file into buf without the
// allocations os.ReadFile makes for its size probe; procfs files report
// size 0 anyway.
func readSmall(path string, buf []byte) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	n := 0
	for n < len(buf) {
		m, err := f.Read(buf[n:])
		n += m
		if err != nil || m == 0 {
			break
		}
	}
	return buf[:n], nil
}
