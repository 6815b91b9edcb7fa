package node

import (
	"bufio"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// HostMetrics reads load, memory and the data directory's disk from the
// kernel. It returns nil when /proc cannot be read, so the report says
// nothing rather than zeros.
func HostMetrics(dataDir string) func() *eitriv1.Metrics {
	return func() *eitriv1.Metrics {
		m := &eitriv1.Metrics{}
		b, err := os.ReadFile("/proc/loadavg")
		if err != nil {
			return nil
		}
		f := strings.Fields(string(b))
		if len(f) >= 3 {
			m.Load1, _ = strconv.ParseFloat(f[0], 64)
			m.Load5, _ = strconv.ParseFloat(f[1], 64)
			m.Load15, _ = strconv.ParseFloat(f[2], 64)
		}
		mem := meminfo()
		m.MemTotalMb, m.MemAvailableMb = mem["MemTotal"]/1024, mem["MemAvailable"]/1024
		var st unix.Statfs_t
		if unix.Statfs(dataDir, &st) == nil {
			bs := uint64(st.Bsize)
			m.DiskTotalGb = int64(st.Blocks * bs >> 30)
			m.DiskFreeGb = int64(st.Bavail * bs >> 30)
			m.DiskUsedGb = int64((st.Blocks - st.Bfree) * bs >> 30)
		}
		return m
	}
}

// meminfo returns /proc/meminfo in KiB by key.
func meminfo() map[string]int64 {
	out := map[string]int64{}
	fh, err := os.Open("/proc/meminfo")
	if err != nil {
		return out
	}
	defer fh.Close()
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err == nil {
			out[k] = n
		}
	}
	return out
}
