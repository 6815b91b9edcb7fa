package guestimage_test

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/seed"
)

// Generous: TCG on a busy two-core machine is several times slower than KVM.
const (
	bootTimeout     = 3 * time.Minute
	shutdownTimeout = time.Minute
)

var readyRE = regexp.MustCompile(`EITRI-GUEST-READY ip=(\S+) hostname=(\S+)`)

// guest is one running test VM, reachable only through loopback forwards.
type guest struct {
	cmd      *exec.Cmd
	exited   chan struct{}
	waitErr  error
	qmpPath  string
	httpPort int
	udpPort  int

	mu     sync.Mutex
	serial strings.Builder
	lines  chan string
}

func (g *guest) console() string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.serial.String()
}

// imageUnderTest returns the built image, or skips saying how to get one.
func imageUnderTest(tb testing.TB) (path, format string) {
	tb.Helper()
	path = os.Getenv("EITRI_GUEST_IMAGE")
	if path == "" {
		tb.Skip("EITRI_GUEST_IMAGE is not set; build with guestimage/build.sh OUTDIR and point it at OUTDIR/eitri-guest.raw")
	}
	if _, err := os.Stat(path); err != nil {
		tb.Skipf("EITRI_GUEST_IMAGE=%s: %v", path, err)
	}
	if _, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		tb.Skip("qemu-system-x86_64 not installed (Debian: qemu-system-x86)")
	}
	format = "raw"
	if strings.HasSuffix(path, ".qcow2") {
		format = "qcow2"
	}
	return path, format
}

// boot starts the image with the given seed under TCG, user-mode networking
// and loopback-only forwards to the guest's port 80 (TCP) and 7 (UDP).
func boot(tb testing.TB, image, format string, p seed.Params) *guest {
	tb.Helper()
	dir := tb.TempDir()
	seedPath := filepath.Join(dir, "seed.iso")
	require.NoError(tb, seed.Write(seedPath, p))

	// A unix socket path must fit in 108 bytes; TempDir paths can be long.
	sockDir, err := os.MkdirTemp("", "eitri-qmp-")
	require.NoError(tb, err)
	tb.Cleanup(func() { os.RemoveAll(sockDir) })

	g := &guest{
		exited:   make(chan struct{}),
		qmpPath:  filepath.Join(sockDir, "qmp.sock"),
		httpPort: hosttest.FreePort(tb, "tcp"),
		udpPort:  hosttest.FreePort(tb, "udp"),
		lines:    make(chan string, 256),
	}
	// Not restrict=on: libslirp's restricted mode drops the replies of a UDP
	// host forward. The guest originates nothing but DHCP to slirp itself.
	netdev := fmt.Sprintf("user,id=n0,hostfwd=tcp:127.0.0.1:%d-:80,hostfwd=udp:127.0.0.1:%d-:7", g.httpPort, g.udpPort)
	g.cmd = exec.Command("qemu-system-x86_64",
		"-machine", "q35,accel=tcg", "-cpu", "max", "-m", "256",
		"-display", "none", "-monitor", "none", "-serial", "stdio", "-no-reboot",
		// snapshot=on: the image is shared between tests and never written.
		"-drive", fmt.Sprintf("file=%s,if=virtio,format=%s,snapshot=on", image, format),
		"-drive", fmt.Sprintf("file=%s,if=virtio,format=raw,readonly=on", seedPath),
		"-netdev", netdev, "-device", "virtio-net-pci,netdev=n0",
		"-qmp", fmt.Sprintf("unix:%s,server=on,wait=off", g.qmpPath),
	)
	stdout, err := g.cmd.StdoutPipe()
	require.NoError(tb, err)
	g.cmd.Stderr = g.cmd.Stdout
	require.NoError(tb, g.cmd.Start())

	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			line := sc.Text()
			g.mu.Lock()
			g.serial.WriteString(line + "\n")
			g.mu.Unlock()
			select {
			case g.lines <- line:
			default: // nobody is waiting for lines any more
			}
		}
	}()
	go func() {
		g.waitErr = g.cmd.Wait()
		close(g.exited)
	}()
	tb.Cleanup(func() {
		select {
		case <-g.exited:
		default:
			_ = g.cmd.Process.Kill()
			<-g.exited
		}
		if tb.Failed() {
			tb.Logf("serial console:\n%s", g.console())
		}
	})
	return g
}

// waitReady returns the ready line's address and hostname.
func (g *guest) waitReady(tb testing.TB) (ip, hostname string) {
	tb.Helper()
	timeout := time.After(bootTimeout)
	for {
		select {
		case line := <-g.lines:
			if m := readyRE.FindStringSubmatch(line); m != nil {
				return m[1], m[2]
			}
		case <-g.exited:
			tb.Fatalf("qemu exited before the guest was ready: %v", g.waitErr)
		case <-timeout:
			tb.Fatalf("no ready line within %s", bootTimeout)
		}
	}
}

// qmp is a minimal QMP client: enough to negotiate and run one command.
func qmp(tb testing.TB, path, command string) {
	tb.Helper()
	conn, err := net.DialTimeout("unix", path, 5*time.Second)
	require.NoError(tb, err)
	defer conn.Close()
	require.NoError(tb, conn.SetDeadline(time.Now().Add(30*time.Second)))
	dec := json.NewDecoder(conn)

	var greeting map[string]json.RawMessage
	require.NoError(tb, dec.Decode(&greeting))
	require.Contains(tb, greeting, "QMP")

	for _, cmd := range []string{"qmp_capabilities", command} {
		_, err := fmt.Fprintf(conn, `{"execute":%q}`+"\n", cmd)
		require.NoError(tb, err)
		for {
			var msg map[string]json.RawMessage
			require.NoError(tb, dec.Decode(&msg))
			if e, ok := msg["error"]; ok {
				tb.Fatalf("qmp %s: %s", cmd, e)
			}
			if _, ok := msg["return"]; ok {
				break
			}
			// Asynchronous events (POWERDOWN, SHUTDOWN...) may interleave.
		}
	}
}

func randomID(tb testing.TB) string {
	b := make([]byte, 4)
	_, err := rand.Read(b)
	require.NoError(tb, err)
	return "i-" + hex.EncodeToString(b)
}

func TestGuestBootsServesAndPowersOff(t *testing.T) {
	image, format := imageUnderTest(t)
	// The guest phones home as cloud-init would: slirp gives it the host's
	// loopback at 10.0.2.2.
	phoned := make(chan url.Values, 1)
	home := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/eitri/phone-home/vm/token" || r.ParseForm() != nil {
			http.NotFound(w, r)
			return
		}
		select {
		case phoned <- r.PostForm:
		default:
		}
	}))
	t.Cleanup(home.Close)
	homePort := home.Listener.Addr().(*net.TCPAddr).Port
	p := seed.Params{InstanceID: randomID(t), Hostname: "eitri-boot-test",
		PhoneHomeURL: fmt.Sprintf("http://10.0.2.2:%d/eitri/phone-home/vm/token", homePort)}

	start := time.Now()
	g := boot(t, image, format, p)
	ip, hostname := g.waitReady(t)
	t.Logf("guest ready after %s (TCG), ip=%s", time.Since(start).Round(100*time.Millisecond), ip)
	assert.Equal(t, p.Hostname, hostname, "the guest named itself from the seed")
	assert.Equal(t, "10.0.2.15", ip, "QEMU user networking leases the first guest this address")

	t.Run("http", func(t *testing.T) {
		client := &http.Client{Timeout: 20 * time.Second}
		resp, err := client.Get(fmt.Sprintf("http://127.0.0.1:%d/", g.httpPort))
		require.NoError(t, err)
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.Contains(t, string(body), "hostname="+p.Hostname)
		assert.Contains(t, string(body), "instance-id="+p.InstanceID)
	})

	t.Run("phone home", func(t *testing.T) {
		select {
		case form := <-phoned:
			assert.Equal(t, p.InstanceID, form.Get("instance_id"))
		case <-time.After(bootTimeout):
			t.Fatalf("the guest did not phone home within %s", bootTimeout)
		}
	})

	t.Run("udp echo", func(t *testing.T) {
		conn, err := net.Dial("udp", fmt.Sprintf("127.0.0.1:%d", g.udpPort))
		require.NoError(t, err)
		defer conn.Close()
		payload := []byte("eitri echo " + p.InstanceID)
		buf := make([]byte, 1500)
		// UDP through slirp may drop the first datagram while the forward
		// warms up; a few tries separate loss from a missing echo server.
		var lastErr error
		for try := 0; try < 5; try++ {
			_, err := conn.Write(payload)
			require.NoError(t, err)
			require.NoError(t, conn.SetReadDeadline(time.Now().Add(3*time.Second)))
			n, err := conn.Read(buf)
			if err == nil {
				assert.Equal(t, payload, buf[:n])
				return
			}
			lastErr = err
		}
		t.Fatalf("no echo after 5 datagrams: %v", lastErr)
	})

	t.Run("acpi powerdown", func(t *testing.T) {
		qmp(t, g.qmpPath, "system_powerdown")
		select {
		case <-g.exited:
		case <-time.After(shutdownTimeout):
			t.Fatalf("qemu still running %s after system_powerdown", shutdownTimeout)
		}
		require.NoError(t, g.waitErr, "a guest-initiated power-off exits qemu cleanly")
		assert.Contains(t, g.console(), "EITRI-GUEST-POWEROFF", "the guest powered itself off")
	})
}

// BenchmarkBootToReady measures seed-to-ready under TCG, the number that
// decides how long every VM-level test waits.
func BenchmarkBootToReady(b *testing.B) {
	image, format := imageUnderTest(b)
	for i := 0; i < b.N; i++ {
		g := boot(b, image, format, seed.Params{InstanceID: randomID(b), Hostname: "eitri-bench"})
		g.waitReady(b)
		b.StopTimer()
		_ = g.cmd.Process.Kill()
		<-g.exited
		b.StartTimer()
	}
}
