package usage

import (
	"bufio"
	"bytes"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

func itoa(n int) string { return strconv.Itoa(n) }

// processCPU is utime+stime of /proc/PID/stat, in seconds.
func processCPU(pdir string) *float64 {
	var buf [1024]byte
	b, err := readSmall(filepath.Join(pdir, "stat"), buf[:])
	if err != nil {
		return nil
	}
	// The command name (field 2) is in parentheses and may hold spaces
	// and parentheses itself: count fields from the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return nil
	}
	f := bytes.Fields(b[i+1:])
	// f[0] is field 3 (state); utime and stime are fields 14 and 15.
	if len(f) < 13 {
		return nil
	}
	ut, err1 := strconv.ParseUint(string(f[11]), 10, 64)
	st, err2 := strconv.ParseUint(string(f[12]), 10, 64)
	if err1 != nil || err2 != nil {
		return nil
	}
	v := float64(ut+st) / userHZ
	return &v
}

// processRSS is VmRSS of /proc/PID/status, in bytes.
func processRSS(pdir string) *uint64 {
	var buf [4096]byte
	b, err := readSmall(filepath.Join(pdir, "status"), buf[:])
	if err != nil {
		return nil
	}
	return kBField(b, "VmRSS:")
}

// kBField finds "key   N kB" in a status-style file and returns N KiB in
// bytes.
func kBField(b []byte, key string) *uint64 {
	for len(b) > 0 {
		line := b
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			line, b = b[:i], b[i+1:]
		} else {
			b = nil
		}
		rest, ok := bytes.CutPrefix(line, []byte(key))
		if !ok {
			continue
		}
		f := bytes.Fields(rest)
		if len(f) == 0 {
			return nil
		}
		n, err := strconv.ParseUint(string(f[0]), 10, 64)
		if err != nil {
			return nil
		}
		if len(f) > 1 && string(f[1]) == "kB" {
			n *= 1024
		}
		return &n
	}
	return nil
}

// hostCPU is the busy time of all CPUs (the "cpu" line of /proc/stat) and
// how many CPUs there are (its "cpuN" lines).
func hostCPU(proc string) (*float64, int) {
	f, err := os.Open(filepath.Join(proc, "stat"))
	if err != nil {
		return nil, 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	var busy *float64
	cpus := 0
	for sc.Scan() {
		line := sc.Bytes()
		if !bytes.HasPrefix(line, []byte("cpu")) {
			break // the per-CPU lines come first; the rest is not ours
		}
		fs := bytes.Fields(line)
		if string(fs[0]) != "cpu" {
			cpus++
			continue
		}
		// user nice system idle iowait irq softirq steal (guest time is
		// already inside user and nice).
		var ticks [8]uint64
		if len(fs) < 1+len(ticks) {
			continue
		}
		ok := true
		for i := range ticks {
			n, err := strconv.ParseUint(string(fs[1+i]), 10, 64)
			if err != nil {
				ok = false
				break
			}
			ticks[i] = n
		}
		if !ok {
			continue
		}
		v := float64(ticks[0]+ticks[1]+ticks[2]+ticks[5]+ticks[6]+ticks[7]) / userHZ
		busy = &v
	}
	return busy, cpus
}

// hostMemory is MemTotal and MemAvailable of /proc/meminfo, in bytes.
func hostMemory(proc string) (total, avail *uint64) {
	var buf [8192]byte
	b, err := readSmall(filepath.Join(proc, "meminfo"), buf[:])
	if err != nil {
		return nil, nil
	}
	return kBField(b, "MemTotal:"), kBField(b, "MemAvailable:")
}

func hostLoad(proc string) (l1, l5, l15 *float64) {
	var buf [256]byte
	b, err := readSmall(filepath.Join(proc, "loadavg"), buf[:])
	if err != nil {
		return nil, nil, nil
	}
	f := bytes.Fields(b)
	if len(f) < 3 {
		return nil, nil, nil
	}
	var out [3]*float64
	for i := range out {
		v, err := strconv.ParseFloat(string(f[i]), 64)
		if err != nil {
			return nil, nil, nil
		}
		out[i] = &v
	}
	return out[0], out[1], out[2]
}

func filesystem(dir string) (total, free *uint64) {
	var st unix.Statfs_t
	if unix.Statfs(dir, &st) != nil {
		return nil, nil
	}
	t, f := st.Blocks*uint64(st.Bsize), st.Bavail*uint64(st.Bsize)
	return &t, &f
}

// ifaceCounters reads one interface's statistics directory.
func ifaceCounters(dev string) *Net {
	var n Net
	for _, c := range []struct {
		name string
		v    *uint64
	}{
		{"rx_bytes", &n.RxBytes}, {"tx_bytes", &n.TxBytes},
		{"rx_packets", &n.RxPackets}, {"tx_packets", &n.TxPackets},
		{"rx_dropped", &n.RxDropped}, {"tx_dropped", &n.TxDropped},
	} {
		var buf [32]byte
		b, err := readSmall(filepath.Join(dev, "statistics", c.name), buf[:])
		if err != nil {
			return nil
		}
		v, err := strconv.ParseUint(string(bytes.TrimSpace(b)), 10, 64)
		if err != nil {
			return nil
		}
		*c.v = v
	}
	return &n
}

// hostNet sums the host's own interfaces. Loopback, bridges and taps are
// left out: a guest's traffic crosses its tap and the bridge before it
// leaves by an uplink, and counting it there too would count it twice.
func hostNet(classNet string) *Net {
	ents, err := os.ReadDir(classNet)
	if err != nil {
		return nil
	}
	var sum Net
	counted := false
	for _, e := range ents {
		dev := filepath.Join(classNet, e.Name())
		if e.Name() == "lo" || exists(filepath.Join(dev, "bridge")) || exists(filepath.Join(dev, "tun_flags")) {
			continue
		}
		n := ifaceCounters(dev)
		if n == nil {
			continue
		}
		counted = true
		sum.RxBytes += n.RxBytes
		sum.TxBytes += n.TxBytes
		sum.RxPackets += n.RxPackets
		sum.TxPackets += n.TxPackets
		sum.RxDropped += n.RxDropped
		sum.TxDropped += n.TxDropped
	}
	if !counted {
		return nil
	}
	return &sum
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}
