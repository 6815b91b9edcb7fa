package hostvm

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Capacity is what this host can give guests, measured where root disks live.
func (h *Hypervisor) Capacity() (vcpus int32, memMB int64, diskGB int64, err error) {
	// VMDir's parent is the backend's root directory.
	return Capacity(filepath.Dir(h.qemu.VMDir("capacity")))
}

// Capacity measures the host: every CPU, the memory left after a reserve for
// the host itself (see memReserveMB), and the size of the filesystem holding
// dataDir (what unprivileged writers may fill; root's reserved blocks are
// not counted). It reports totals, not what is free: the control plane
// subtracts what its VMs were given.
func Capacity(dataDir string) (vcpus int32, memMB int64, diskGB int64, err error) {
	total, err := hostMemMB()
	if err != nil {
		return 0, 0, 0, err
	}
	var fs unix.Statfs_t
	if err := unix.Statfs(dataDir, &fs); err != nil {
		return 0, 0, 0, fmt.Errorf("hostvm: statfs %s: %w", dataDir, err)
	}
	usable := fs.Blocks - (fs.Bfree - fs.Bavail)
	disk := int64(usable) * int64(fs.Frsize) >> 30
	return int32(runtime.NumCPU()), max(total-memReserveMB(total), 0), disk, nil
}

// memReserveMB keeps a tenth of the host's memory, at least 512 MiB and at
// most 4 GiB, for the kernel, the agent and QEMU's own overhead.
func memReserveMB(totalMB int64) int64 {
	return min(max(totalMB/10, 512), 4096)
}

// hostMemMB is MemTotal from /proc/meminfo, in MiB.
func hostMemMB() (int64, error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("hostvm: %w", err)
	}
	defer f.Close()
	return parseMemTotal(f)
}

func parseMemTotal(r io.Reader) (int64, error) {
	s := bufio.NewScanner(r)
	for s.Scan() {
		rest, ok := strings.CutPrefix(s.Text(), "MemTotal:")
		if !ok {
			continue
		}
		fields := strings.Fields(rest)
		if len(fields) != 2 || fields[1] != "kB" {
			return 0, fmt.Errorf("hostvm: unexpected MemTotal line %q", s.Text())
		}
		kb, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("hostvm: MemTotal: %w", err)
		}
		return kb >> 10, nil
	}
	if err := s.Err(); err != nil {
		return 0, fmt.Errorf("hostvm: read meminfo: %w", err)
	}
	return 0, errors.New("hostvm: no MemTotal in /proc/meminfo")
}
