// Package netnstest runs a test body inside a network namespace the test
// creates and removes, so tests of bridges, taps, NAT, DHCP and guests touch
// nothing on the machine. It is imported by tests only.
package netnstest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// innerEnv tells a re-executed test binary which test to run for real.
const innerEnv = "EITRI_TEST_IN_NETNS"

// Inside reports whether this process is the re-executed child.
func Inside(t *testing.T) bool { return os.Getenv(innerEnv) == t.Name() }

// Run runs body in a fresh network namespace. The whole test binary is
// re-executed under `ip netns exec`, so every thread and goroutine (DHCP
// server, netlink and nftables sockets, QEMU) lives in the namespace;
// pinning one goroutine's thread with netns.Set would leave library
// goroutines on other threads in the host's namespace. Processes left in the
// namespace (QEMU daemonizes) are killed before it is deleted. why says what
// the test needs root for, for the skip message.
func Run(t *testing.T, timeout time.Duration, why string, body func(t *testing.T)) {
	t.Helper()
	if Inside(t) {
		body(t)
		return
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: " + why)
	}
	ip, err := exec.LookPath("ip")
	if err != nil {
		t.Skip("needs iproute2's ip to create a network namespace (apt-get install iproute2)")
	}
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	ns := "eitri-test-" + hex.EncodeToString(suffix)
	out, err := exec.Command(ip, "netns", "add", ns).CombinedOutput()
	require.NoError(t, err, "ip netns add: %s", out)
	t.Cleanup(func() {
		if pids, err := exec.Command(ip, "netns", "pids", ns).Output(); err == nil {
			for _, f := range strings.Fields(string(pids)) {
				if pid, err := strconv.Atoi(f); err == nil {
					_ = syscall.Kill(pid, syscall.SIGKILL)
				}
			}
		}
		out, err := exec.Command(ip, "netns", "del", ns).CombinedOutput()
		assert.NoError(t, err, "ip netns del: %s", out)
		_, err = os.Stat(filepath.Join("/run/netns", ns))
		assert.True(t, os.IsNotExist(err), "namespace %s left behind", ns)
	})
	require.NoError(t, exec.Command(ip, "netns", "exec", ns, ip, "link", "set", "lo", "up").Run())

	ctx, cancel := context.WithTimeout(context.Background(), timeout+10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, ip, "netns", "exec", ns, os.Args[0],
		"-test.run=^"+regexp.QuoteMeta(t.Name())+"$", "-test.count=1", "-test.v", "-test.timeout="+timeout.String())
	cmd.Env = append(os.Environ(), innerEnv+"="+t.Name())
	out, err = cmd.CombinedOutput()
	t.Logf("inside %s:\n%s", ns, out)
	require.NoError(t, err)
	switch verdict, reason := innerResult(string(out), t.Name()); verdict {
	case "PASS":
	case "SKIP":
		// The body found inside that it cannot run here (no /dev/kvm, say):
		// that is the test's answer, so it is passed on as a skip with its
		// reason rather than counted as a failure.
		t.Skip(reason)
	default:
		t.Fatalf("the test body did not run inside the namespace: no PASS or SKIP line for %s", t.Name())
	}
}

// innerResult reads the re-executed binary's -test.v output for the test's
// own verdict line ("--- PASS: name", "--- SKIP: name") and, for a skip, the
// message the body gave: the indented lines go test prints just before the
// verdict.
func innerResult(out, name string) (verdict, reason string) {
	lines := strings.Split(out, "\n")
	for i, line := range lines {
		trimmed := strings.TrimSpace(line)
		for _, v := range []string{"PASS", "SKIP", "FAIL"} {
			if !strings.HasPrefix(trimmed, "--- "+v+": "+name+" (") {
				continue
			}
			if v != "SKIP" {
				return v, ""
			}
			indent := line[:len(line)-len(strings.TrimLeft(line, " "))] + "    "
			var msg []string
			for j := i - 1; j >= 0 && strings.HasPrefix(lines[j], indent); j-- {
				msg = append([]string{strings.TrimSpace(lines[j])}, msg...)
			}
			return v, strings.Join(msg, "\n")
		}
	}
	return "", ""
}
