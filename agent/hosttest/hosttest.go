// Package hosttest holds what tests of the host side share (the agent's
// building blocks, the agent, the commands that run it): a logger into the
// test's own output, a skip when QEMU is missing, a free loopback port and a
// log sink a test can read. It is imported by tests only.
package hosttest

import (
	"log/slog"
	"net"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// Logger writes at debug level into the test's output, so a failing test
// shows what the code under it said, and a passing one stays quiet.
func Logger(tb testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tb.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// NeedQEMU skips the test, saying how to install them, when QEMU's binaries
// are not on the PATH.
func NeedQEMU(tb testing.TB) {
	tb.Helper()
	for _, bin := range []string{"qemu-system-x86_64", "qemu-img"} {
		if _, err := exec.LookPath(bin); err != nil {
			tb.Skipf("%s not on PATH (apt-get install qemu-system-x86 qemu-utils)", bin)
		}
	}
}

// FreePort returns a port on 127.0.0.1 that was free a moment ago, for
// network "tcp" or "udp".
func FreePort(tb testing.TB, network string) int {
	tb.Helper()
	if network == "udp" {
		c, err := net.ListenPacket("udp", "127.0.0.1:0")
		require.NoError(tb, err)
		defer c.Close()
		return c.LocalAddr().(*net.UDPAddr).Port
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(tb, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// LogBuffer is a concurrency-safe log sink a test reads back: give its
// Logger to the code under test, then look in String for what it said.
type LogBuffer struct {
	mu  sync.Mutex
	buf strings.Builder
}

func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.String()
}

// Logger logs into the buffer at info level and above.
func (l *LogBuffer) Logger() *slog.Logger { return slog.New(slog.NewTextHandler(l, nil)) }
