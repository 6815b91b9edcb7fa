package netsetup

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

const (
	tunDevice   = "/dev/net/tun"
	capNetAdmin = 12 // linux/capability.h
)

// Requirements lists what this host lacks to give guests a network (the
// bridge, taps and NAT), one line per missing piece, each saying how to fix
// it. Empty means ready.
func Requirements() []string {
	return requirements(tunDevice, os.Geteuid(), readCapEff)
}

func requirements(tun string, euid int, capEff func() (uint64, error)) []string {
	var missing []string
	if euid != 0 {
		caps, err := capEff()
		if err != nil || caps&(1<<capNetAdmin) == 0 {
			missing = append(missing, "not root and no CAP_NET_ADMIN: run the agent as root (or grant it CAP_NET_ADMIN, e.g. AmbientCapabilities=CAP_NET_ADMIN in its systemd unit) so it can manage the bridge, taps and NAT")
		}
	}
	if fi, err := os.Stat(tun); err != nil || fi.Mode()&os.ModeCharDevice == 0 {
		missing = append(missing, fmt.Sprintf("%s missing: modprobe tun (in a container, pass the device through, e.g. --device /dev/net/tun)", tun))
	}
	return missing
}

// readCapEff returns this process's effective capability set.
func readCapEff() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "CapEff:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	return 0, errors.New("CapEff not found in /proc/self/status")
}
