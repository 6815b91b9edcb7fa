package usage

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// fakeHost is a /proc and /sys tree in a temporary directory, shaped like
// the kernel's.
type fakeHost struct {
	proc, sys string
}

func newFakeHost(t testing.TB) *fakeHost {
	dir := t.(interface{ TempDir() string }).TempDir()
	h := &fakeHost{proc: filepath.Join(dir, "proc"), sys: filepath.Join(dir, "sys")}
	write(t, filepath.Join(h.proc, "stat"), "cpu  1000 50 250 9000 100 10 20 5 300 0\ncpu0 500 25 125 4500 50 5 10 2 150 0\ncpu1 500 25 125 4500 50 5 10 3 150 0\nintr 12345 0 0\nctxt 999\n")
	write(t, filepath.Join(h.proc, "meminfo"), "MemTotal:        8000000 kB\nMemFree:         1000000 kB\nMemAvailable:    6000000 kB\n")
	write(t, filepath.Join(h.proc, "loadavg"), "0.50 0.25 0.10 2/300 12345\n")
	h.iface(t, "lo", 999, 999, "")
	h.iface(t, "eth0", 5000, 7000, "")
	h.iface(t, "eth1", 1000, 3000, "")
	h.iface(t, "eitri0", 111, 111, "bridge")
	return h
}

func write(t testing.TB, path, content string) {
	require.NoError(t, os.MkdirAll(filepath.Dir(path), 0o755))
	require.NoError(t, os.WriteFile(path, []byte(content), 0o644))
}

// iface makes /sys/class/net/NAME with its counters; kind "bridge" or
// "tap" marks it the way the kernel does.
func (h *fakeHost) iface(t testing.TB, name string, rx, tx uint64, kind string) {
	dev := filepath.Join(h.sys, "class", "net", name)
	for k, v := range map[string]uint64{"rx_bytes": rx, "tx_bytes": tx, "rx_packets": rx / 100, "tx_packets": tx / 100, "rx_dropped": 1, "tx_dropped": 2} {
		write(t, filepath.Join(dev, "statistics", k), fmt.Sprintf("%d\n", v))
	}
	switch kind {
	case "bridge":
		require.NoError(t, os.MkdirAll(filepath.Join(dev, "bridge"), 0o755))
	case "tap":
		write(t, filepath.Join(dev, "tun_flags"), "0x1002\n")
	}
}

// process makes /proc/PID with a QEMU's stat and status.
func (h *fakeHost) process(t testing.TB, pid int, utime, stime, rssKB uint64) {
	dir := filepath.Join(h.proc, itoa(pid))
	write(t, filepath.Join(dir, "stat"), fmt.Sprintf("%d (qemu-system-x86) S 1 %d %d 0 -1 4194560 50000 0 0 0 %d %d 0 0 20 0 3 0 1000 1500000000 40000 18446744073709551615 1 1 0 0 0 0 0 4096 0 0 0 0 17 1 0 0 0 0 0\n", pid, pid, pid, utime, stime))
	write(t, filepath.Join(dir, "status"), fmt.Sprintf("Name:\tqemu-system-x86\nState:\tS (sleeping)\nPid:\t%d\nVmPeak:\t 2000000 kB\nVmRSS:\t  %d kB\nThreads:\t3\n", pid, rssKB))
}

func TestAGuestIsMeasuredFromItsProcessTapAndHypervisor(t *testing.T) {
	h := newFakeHost(t)
	h.process(t, 4242, 1234, 766, 300000)
	h.iface(t, "tap-vm1", 4096, 8192, "tap")
	at := time.Unix(1700000000, 0)
	s := &Sampler{Proc: h.proc, Sys: h.sys, Now: func() time.Time { return at },
		Guests: func(context.Context) []Guest { return []Guest{{ID: "vm1", PID: 4242, Tap: "tap-vm1"}} },
		IO: func(_ context.Context, id string) (IO, error) {
			require.Equal(t, "vm1", id)
			return IO{Disk: Disk{ReadBytes: 10, WriteBytes: 20, ReadOps: 1, WriteOps: 2}}, nil
		},
	}
	_, vms := s.Sample(context.Background())
	require.Len(t, vms, 1)
	v := vms[0]
	assert.Equal(t, "vm1", v.ID)
	assert.Equal(t, at, v.At)
	require.NotNil(t, v.CPUSeconds)
	assert.InDelta(t, 20.0, *v.CPUSeconds, 1e-9, "utime+stime of 2000 ticks at USER_HZ 100")
	require.NotNil(t, v.RSSBytes)
	assert.Equal(t, uint64(300000*1024), *v.RSSBytes)
	assert.Equal(t, &Disk{ReadBytes: 10, WriteBytes: 20, ReadOps: 1, WriteOps: 2}, v.Disk)
	assert.Nil(t, v.BalloonBytes)
	assert.Equal(t, &Net{RxBytes: 4096, TxBytes: 8192, RxPackets: 40, TxPackets: 81, RxDropped: 1, TxDropped: 2}, v.Net)
}

func TestACommandNameWithSpacesAndParenthesesDoesNotShiftTheFields(t *testing.T) {
	h := newFakeHost(t)
	dir := filepath.Join(h.proc, "7")
	write(t, filepath.Join(dir, "stat"), "7 (qemu (x) 1 2) S 1 7 7 0 -1 0 0 0 0 0 300 200 0 0 20 0 1 0 0 0 0\n")
	got := processCPU(dir)
	require.NotNil(t, got)
	assert.InDelta(t, 5.0, *got, 1e-9)
}

func TestWhatCouldNotBeReadIsAbsentNotZero(t *testing.T) {
	h := newFakeHost(t)
	s := &Sampler{Proc: h.proc, Sys: h.sys,
		// The process is gone, the tap does not exist, QEMU did not answer.
		Guests: func(context.Context) []Guest { return []Guest{{ID: "vm1", PID: 999, Tap: "tap-gone"}, {ID: "vm2"}} },
		IO:     func(context.Context, string) (IO, error) { return IO{}, errors.New("qmp dial: no such file") },
	}
	_, vms := s.Sample(context.Background())
	require.Len(t, vms, 2)
	for _, v := range vms {
		assert.Nil(t, v.CPUSeconds, v.ID)
		assert.Nil(t, v.RSSBytes, v.ID)
		assert.Nil(t, v.Disk, v.ID)
		assert.Nil(t, v.Net, v.ID)
		assert.Nil(t, v.BalloonBytes, v.ID)
	}

	empty := &Sampler{Proc: filepath.Join(t.TempDir(), "none"), Sys: filepath.Join(t.TempDir(), "none"),
		Guests: func(context.Context) []Guest { return nil }}
	host, _ := empty.Sample(context.Background())
	assert.Nil(t, host.CPUBusySeconds)
	assert.Zero(t, host.CPUs)
	assert.Nil(t, host.MemTotalBytes)
	assert.Nil(t, host.MemAvailableBytes)
	assert.Nil(t, host.Load1)
	assert.Nil(t, host.Net)
	assert.Nil(t, host.FSTotalBytes, "no data dir given, no filesystem figures")
}

func TestTheHostIsMeasuredFromProcAndItsOwnInterfaces(t *testing.T) {
	h := newFakeHost(t)
	h.iface(t, "tap-vm1", 4096, 8192, "tap")
	s := &Sampler{Proc: h.proc, Sys: h.sys, DataDir: t.TempDir(), Guests: func(context.Context) []Guest { return nil }}
	host, vms := s.Sample(context.Background())
	assert.Empty(t, vms)
	require.NotNil(t, host.CPUBusySeconds)
	// user+nice+system+irq+softirq+steal = 1000+50+250+10+20+5 ticks.
	assert.InDelta(t, 13.35, *host.CPUBusySeconds, 1e-9)
	assert.Equal(t, 2, host.CPUs)
	assert.Equal(t, uint64(8000000*1024), *host.MemTotalBytes)
	assert.Equal(t, uint64(6000000*1024), *host.MemAvailableBytes)
	assert.Equal(t, 0.5, *host.Load1)
	assert.Equal(t, 0.25, *host.Load5)
	assert.Equal(t, 0.1, *host.Load15)
	require.NotNil(t, host.Net)
	assert.Equal(t, uint64(6000), host.Net.RxBytes, "eth0 and eth1; not lo, the bridge or the tap")
	assert.Equal(t, uint64(10000), host.Net.TxBytes)
	require.NotNil(t, host.FSTotalBytes)
	require.NotNil(t, host.FSFreeBytes)
	assert.Positive(t, *host.FSTotalBytes)
	assert.LessOrEqual(t, *host.FSFreeBytes, *host.FSTotalBytes)
}

// BenchmarkSample100VMs is one sampling pass of a host with 100 guests, on
// a fake /proc and /sys (the same files the kernel serves, read the same
// way) and a hypervisor that answers at once. Its ns/op, divided by the
// 10 s interval, is the share of a core sampling costs: 1 % is 100 ms/op.
func BenchmarkSample100VMs(b *testing.B) {
	h := newFakeHost(b)
	guests := make([]Guest, 100)
	for i := range guests {
		pid := 1000 + i
		tap := fmt.Sprintf("tap-vm%d", i)
		h.process(b, pid, uint64(i*10), uint64(i*5), 250000)
		h.iface(b, tap, uint64(i)*1000, uint64(i)*2000, "tap")
		guests[i] = Guest{ID: fmt.Sprintf("vm%d", i), PID: pid, Tap: tap}
	}
	s := &Sampler{Proc: h.proc, Sys: h.sys, DataDir: b.TempDir(),
		Guests: func(context.Context) []Guest { return guests },
		IO:     func(context.Context, string) (IO, error) { return IO{Disk: Disk{ReadBytes: 1}}, nil },
	}
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		_, vms := s.Sample(ctx)
		if len(vms) != 100 || vms[99].CPUSeconds == nil || vms[99].Net == nil {
			b.Fatal("a guest went unmeasured")
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(10*time.Second)*100, "%core@10s")
}
