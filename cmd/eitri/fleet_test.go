package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/netnstest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/jointoken"
)

// The fleet test runs the real binary as separate processes: a TLS control
// plane in the test's network namespace and two agents, each in a namespace
// of its own, joined by a private LAN (a bridge in the control plane's
// namespace, a veth per host):
//
//	control plane  192.168.77.1   (bridge, eitri server, the image server, this test)
//	host-a         192.168.77.11  (eitri agent, its guests)
//	host-b         192.168.77.12
const (
	fleetBaseEnv = "EITRI_FLEET_BASE"
	lanPrefix    = "192.168.77."
	cpIP         = lanPrefix + "1"
	cpPort       = "7443"
	cpURL        = "https://" + cpIP + ":" + cpPort
)

func TestFleetOfTwoHostsOnALANSurvivesKillsOutagesAndAnImposter(t *testing.T) {
	fleetTest(t, 10*time.Minute, "a control plane and two agents, each in its own network namespace", runFleet)
}

// fleetTest runs body (a fleet run at base) inside a network namespace of
// its own, once what it needs is there; the sweep after it removes what the
// run left, even when the inner test was killed.
func fleetTest(t *testing.T, timeout time.Duration, what string, body func(t *testing.T, base string)) {
	if netnstest.Inside(t) {
		body(t, os.Getenv(fleetBaseEnv))
		return
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: the test makes network namespaces, a bridge and veths, and the agents make bridges, taps and NAT")
	}
	bin := os.Getenv("EITRI_BIN")
	if bin == "" {
		t.Skip("EITRI_BIN is not set: build the binary with `make build` and point EITRI_BIN at bin/eitri (make test does)")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Skipf("EITRI_BIN: %v", err)
	}
	if os.Getenv("EITRI_GUEST_IMAGE") == "" {
		t.Skip("EITRI_GUEST_IMAGE is not set: build the test guest with `make guest-image` (make test does)")
	}
	for _, b := range []string{"qemu-system-x86_64", "qemu-img", "ip"} {
		if _, err := exec.LookPath(b); err != nil {
			t.Skipf("%s not installed (make deps installs it)", b)
		}
	}
	// Everything the run leaves (data dirs, logs, the agents' namespaces)
	// is named after base, so the sweep below finds it even when the inner
	// test was killed before its own cleanups ran.
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	base := filepath.Join(os.TempDir(), "eitri-fleet-"+hex.EncodeToString(suffix))
	require.NoError(t, os.MkdirAll(base, 0o755))
	t.Setenv(fleetBaseEnv, base)
	t.Cleanup(func() { sweepFleet(t, base) })
	netnstest.Run(t, timeout, what, func(*testing.T) {})
}

// elsewhereFile, in base, lists directories outside base that the run made
// (PostgreSQL's, which must be where its own user can reach), one a line,
// for the sweep.
const elsewhereFile = "elsewhere"

// agentNS is the network namespace of one host of the run at base.
func agentNS(base, host string) string { return filepath.Base(base) + "-" + host }

// sweepFleet kills whatever the run left running (QEMU outlives its agent
// by design), removes the agents' namespaces and the data, and keeps the
// logs when the test failed.
func sweepFleet(t *testing.T, base string) {
	for _, h := range []string{"a", "b"} {
		ns := agentNS(base, h)
		if _, err := os.Stat(filepath.Join("/run/netns", ns)); err == nil {
			if out, err := exec.Command("ip", "netns", "pids", ns).Output(); err == nil {
				for _, f := range strings.Fields(string(out)) {
					if pid, err := strconv.Atoi(f); err == nil {
						_ = syscall.Kill(pid, syscall.SIGKILL)
					}
				}
			}
			_ = exec.Command("ip", "netns", "del", ns).Run()
		}
	}
	// Processes of this run name its base directory on their command line
	// (--data-dir, QEMU's disk and socket paths), or a directory it made
	// elsewhere; nothing else does.
	roots := []string{base}
	if b, err := os.ReadFile(filepath.Join(base, elsewhereFile)); err == nil {
		roots = append(roots, strings.Fields(string(b))...)
	}
	procs, _ := filepath.Glob("/proc/[0-9]*/cmdline")
	for _, p := range procs {
		cmdline, err := os.ReadFile(p)
		if err != nil || !slices.ContainsFunc(roots, func(r string) bool { return bytes.Contains(cmdline, []byte(r+"/")) }) {
			continue
		}
		if pid, err := strconv.Atoi(filepath.Base(filepath.Dir(p))); err == nil && pid != os.Getpid() {
			t.Logf("killing leftover process %d: %s", pid, bytes.ReplaceAll(cmdline, []byte{0}, []byte{' '}))
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	time.Sleep(200 * time.Millisecond) // let killed QEMUs let go of their disks
	for _, dir := range roots[1:] {
		assert.NoError(t, os.RemoveAll(dir))
	}
	for _, h := range []string{"a", "b"} {
		_, err := os.Stat(filepath.Join("/run/netns", agentNS(base, h)))
		assert.True(t, os.IsNotExist(err), "namespace %s left behind", agentNS(base, h))
	}
	entries, _ := os.ReadDir(base)
	for _, e := range entries {
		if e.Name() == "logs" && t.Failed() {
			continue
		}
		assert.NoError(t, os.RemoveAll(filepath.Join(base, e.Name())))
	}
	if t.Failed() {
		t.Logf("process logs kept in %s", filepath.Join(base, "logs"))
		return
	}
	assert.NoError(t, os.Remove(base))
}

// fleetRun is the run inside the control plane's namespace.
type fleetRun struct {
	bin, base  string
	logs       string
	imageURL   string
	imageSum   string
	accelFlags []string
	agentUsage string // eitri agent -h

	mu    sync.Mutex
	procs []*proc

	server *proc
	fp     string // the real control plane's certificate fingerprint
	hc     *http.Client
	auth   connect.ClientOption
	hosts  *table[*eitriv1.Host]
	vms    *table[*eitriv1.VM]
}

// proc is one run of the eitri binary, its output in a log file.
type proc struct {
	name, log string
	cmd       *exec.Cmd
	done      chan struct{}
	err       error
}

func (p *proc) pid() int { return p.cmd.Process.Pid }

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// stop asks the process to end (SIGTERM) and waits for it.
func (p *proc) stop(t *testing.T) {
	t.Helper()
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		p.kill()
		t.Errorf("%s did not stop within 30s of SIGTERM (killed; log %s)", p.name, p.log)
	}
}

// logSize and logSince read a process's log from an offset, for "what did
// it say since ...".
func (p *proc) logSize() int64 {
	st, err := os.Stat(p.log)
	if err != nil {
		return 0
	}
	return st.Size()
}

func (p *proc) logSince(off int64) string {
	b, _ := os.ReadFile(p.log)
	if int64(len(b)) < off {
		return ""
	}
	return string(b[off:])
}

// start runs the binary with args, in network namespace ns ("" for this
// one). `ip netns exec` execs the binary in place, so the pid is eitri's.
func (f *fleetRun) start(t *testing.T, name, ns string, args ...string) *proc {
	t.Helper()
	argv := append([]string{f.bin}, args...)
	if ns != "" {
		argv = append([]string{"ip", "netns", "exec", ns}, argv...)
	}
	p := startProc(t, f.logs, name, argv...)
	f.mu.Lock()
	f.procs = append(f.procs, p)
	f.mu.Unlock()
	return p
}

// startProc runs argv with its output appended to logs/name.log. Ending it
// is the caller's.
func startProc(t *testing.T, logs, name string, argv ...string) *proc {
	t.Helper()
	path := filepath.Join(logs, name+".log")
	lf, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	require.NoError(t, err)
	defer lf.Close()
	fmt.Fprintf(lf, "=== %s %s\n", time.Now().Format(time.RFC3339Nano), strings.Join(argv, " "))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = lf, lf
	require.NoError(t, cmd.Start(), "start %s", name)
	p := &proc{name: name, log: path, cmd: cmd, done: make(chan struct{})}
	go func() { p.err = cmd.Wait(); close(p.done) }()
	return p
}

// runOnce runs a command that is expected to end by itself and returns its
// output; it is killed if it is still running after within.
func (f *fleetRun) runOnce(t *testing.T, name, ns string, within time.Duration, args ...string) (out string, err error, stillRunning bool) {
	t.Helper()
	p := f.start(t, name, ns, args...)
	select {
	case <-p.done:
	case <-time.After(within):
		p.kill()
		stillRunning = true
	}
	b, _ := os.ReadFile(p.log)
	return string(b), p.err, stillRunning
}

func (f *fleetRun) agentArgs(name, dir string, extra ...string) []string {
	args := []string{"agent", "--data-dir", dir, "--name", "host-" + name,
		"--address", hostIP(name), "--vm-timeout", "5m", "--log-level", "debug",
		// The image server is on the private LAN, refused unless allowed.
		"--image-allow", lanPrefix + "0/24"}
	args = append(args, f.accelFlags...)
	return append(args, extra...)
}

func hostIP(name string) string {
	if name == "a" {
		return lanPrefix + "11"
	}
	return lanPrefix + "12"
}

func (f *fleetRun) serverArgs(dir string) []string {
	return []string{"server", "--listen", cpIP + ":" + cpPort, "--data-dir", dir,
		"--tls-hosts", cpIP, "--public-url", cpURL, "--delete-grace", "1m"}
}

func sh(t *testing.T, args ...string) {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	require.NoError(t, err, "%s: %s", strings.Join(args, " "), out)
}

// lan makes the private LAN: a bridge here, and per host a namespace with
// a veth whose other end is on the bridge. Removed at cleanup, after every
// process in it is killed (QEMU outlives its agent by design).
func (f *fleetRun) lan(t *testing.T) {
	sh(t, "ip", "link", "add", "flan0", "type", "bridge")
	sh(t, "ip", "addr", "add", cpIP+"/24", "dev", "flan0")
	sh(t, "ip", "link", "set", "flan0", "up")
	for _, h := range []string{"a", "b"} {
		ns := agentNS(f.base, h)
		sh(t, "ip", "netns", "add", ns)
		t.Cleanup(func() {
			if out, err := exec.Command("ip", "netns", "pids", ns).Output(); err == nil {
				for _, fld := range strings.Fields(string(out)) {
					if pid, err := strconv.Atoi(fld); err == nil {
						_ = syscall.Kill(pid, syscall.SIGKILL)
					}
				}
			}
			out, err := exec.Command("ip", "netns", "del", ns).CombinedOutput()
			assert.NoError(t, err, "ip netns del %s: %s", ns, out)
		})
		sh(t, "ip", "link", "add", "fv"+h, "type", "veth", "peer", "name", "lan0", "netns", ns)
		sh(t, "ip", "link", "set", "fv"+h, "master", "flan0", "up")
		sh(t, "ip", "-n", ns, "addr", "add", hostIP(h)+"/24", "dev", "lan0")
		sh(t, "ip", "-n", ns, "link", "set", "lan0", "up")
		sh(t, "ip", "-n", ns, "link", "set", "lo", "up")
	}
}

// serveImage serves the test guest on the LAN, for the agents to download.
func (f *fleetRun) serveImage(t *testing.T) {
	path := os.Getenv("EITRI_GUEST_IMAGE")
	data, err := os.ReadFile(path)
	require.NoError(t, err)
	sum := sha256.Sum256(data)
	f.imageSum = hex.EncodeToString(sum[:])
	ln, err := net.Listen("tcp", cpIP+":0")
	require.NoError(t, err)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Range") != "" {
			http.ServeContent(w, r, "guest.raw", time.Time{}, bytes.NewReader(data))
			return
		}
		// Paced (about 0.4 s for the test guest): a download on loopback
		// is over in milliseconds, so a watcher on another replica, which
		// hears the latest state, could miss the step the tests require
		// it to see.
		servePaced(w, data)
	})}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })
	f.imageURL = "http://" + ln.Addr().String() + "/guest.raw"
}

// fingerprint is the sha256 of the certificate the server at addr presents,
// as join tokens carry it.
func fingerprint(addr string) (string, error) {
	c, err := tls.DialWithDialer(&net.Dialer{Timeout: 2 * time.Second}, "tcp", addr,
		&tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}}) // read, not trusted
	if err != nil {
		return "", err
	}
	defer c.Close()
	certs := c.ConnectionState().PeerCertificates
	if len(certs) == 0 {
		return "", errors.New("no certificate")
	}
	sum := sha256.Sum256(certs[0].Raw)
	return hex.EncodeToString(sum[:]), nil
}

// startServer starts a control plane on the LAN address with dir as its
// data dir, and returns once it serves, with the fingerprint of its
// certificate and its admin token.
func (f *fleetRun) startServer(t *testing.T, name, dir string) (p *proc, fp, token string) {
	t.Helper()
	p, fp = f.startServing(t, name, cpIP+":"+cpPort, f.serverArgs(dir)...)
	b, err := os.ReadFile(filepath.Join(dir, "admin.token"))
	require.NoError(t, err, "the control plane writes its admin token to <data-dir>/admin.token")
	return p, fp, strings.TrimSpace(string(b))
}

// startServing starts `eitri server args` and returns once it serves TLS
// and /healthz at addr, with the fingerprint of its certificate.
func (f *fleetRun) startServing(t *testing.T, name, addr string, args ...string) (p *proc, fp string) {
	t.Helper()
	p = f.start(t, name, "", args...)
	return p, waitServing(t, p, addr)
}

// waitServing waits until the server p serves TLS and /healthz at addr,
// and returns the fingerprint of its certificate.
func waitServing(t *testing.T, p *proc, addr string) (fp string) {
	t.Helper()
	name := p.name
	waitUntil(t, 30*time.Second, name+" serves TLS on "+addr, func() (bool, string) {
		if p.exited() {
			t.Fatalf("%s exited: %v; log %s:\n%s", name, p.err, p.log, tail(p.log, 30))
		}
		var err error
		if fp, err = fingerprint(addr); err != nil {
			return false, err.Error()
		}
		resp, err := connclient.HTTPClient(fp).Get("https://" + addr + "/healthz")
		if err != nil {
			return false, err.Error()
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status
	})
	return fp
}

func (f *fleetRun) hostClient() eitriv1connect.HostServiceClient { return f.hostClientAt(cpURL) }

func (f *fleetRun) hostClientAt(url string) eitriv1connect.HostServiceClient {
	return eitriv1connect.NewHostServiceClient(f.hc, url, f.auth)
}

func (f *fleetRun) joinToken(t *testing.T) string {
	t.Helper()
	return f.joinTokenFrom(t, cpURL, []string{cpURL})
}

// joinTokenFrom mints a join token through the control plane at url; it
// must name urls (--public-url), the first the one agents dial first.
func (f *fleetRun) joinTokenFrom(t *testing.T, url string, urls []string) string {
	t.Helper()
	r, err := f.hostClientAt(url).CreateJoinToken(context.Background(), connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
	require.NoError(t, err)
	jt, err := jointoken.Decode(r.Msg.Token)
	require.NoError(t, err)
	assert.Equal(t, f.fp, jt.GetCertFingerprint(), "the join token carries the fingerprint of the certificate the control plane presents")
	assert.Equal(t, urls[0], jt.GetUrl(), "the join token carries --public-url")
	assert.Equal(t, urls, jointoken.URLs(jt), "the join token carries --public-url")
	return r.Msg.Token
}

func (f *fleetRun) hostNamed(name string) *eitriv1.Host {
	for _, h := range f.hosts.all() {
		if h.Name == name {
			return h
		}
	}
	return nil
}

// waitEnrolled waits until agent, the agent of host-h, has enrolled,
// connected and reported its capacity, and returns the host as the
// control plane's watch stream shows it.
func (f *fleetRun) waitEnrolled(t *testing.T, h string, agent *proc) *eitriv1.Host {
	t.Helper()
	var x *eitriv1.Host
	waitUntil(t, 2*time.Minute, "host-"+h+" enrolls, connects and reports its capacity", func() (bool, string) {
		if agent.exited() {
			t.Fatalf("agent-%s exited: %v", h, agent.err)
		}
		if x = f.hostNamed("host-" + h); x == nil {
			return false, "not enrolled"
		}
		return x.Connected && x.Capacity != nil, fmt.Sprintf("connected=%v capacity=%v", x.Connected, x.Capacity)
	})
	return x
}

// mustRun runs the step name of a run whose later steps build on it, and
// stops t there if it fails.
func mustRun(t *testing.T, name string, fn func(t *testing.T)) {
	t.Helper()
	if !t.Run(name, fn) {
		t.FailNow()
	}
}

// waitConnected waits until the host is connected (true) or not (false),
// as the control plane's watch stream says.
func (f *fleetRun) waitConnected(t *testing.T, id string, want bool, within time.Duration, why string) {
	t.Helper()
	waitUntil(t, within, why, func() (bool, string) {
		h, ok := f.hosts.get(id)
		if !ok {
			return false, "host not in the watched list (watch stream reconnecting?)"
		}
		return h.Connected == want && (!want || h.Capacity != nil), fmt.Sprintf("connected=%v capacity=%v", h.Connected, h.Capacity)
	})
}

// waitUnreported waits until the VM is no longer shown ready: its host
// went away, and nobody can say.
func (f *fleetRun) waitUnreported(t *testing.T, id string, why string) {
	t.Helper()
	waitUntil(t, 10*time.Second, why, func() (bool, string) {
		v, ok := f.vms.get(id)
		if !ok {
			return false, "VM not in the watched list"
		}
		return v.Lifecycle != "ready", fmt.Sprintf("lifecycle=%q", v.Lifecycle)
	})
}

func (f *fleetRun) waitReady(t *testing.T, id string, within time.Duration, why string) *eitriv1.VM {
	t.Helper()
	var vm *eitriv1.VM
	waitUntil(t, within, why, func() (bool, string) {
		v, ok := f.vms.get(id)
		if !ok {
			return false, "VM not in the watched list"
		}
		vm = v
		if v.Lifecycle == "failed" {
			t.Fatalf("%s: the VM failed: %s", why, v.LastError)
		}
		return v.Lifecycle == "ready" && v.AssignedIp != "",
			fmt.Sprintf("lifecycle=%q detail=%q ip=%q last_error=%q", v.Lifecycle, v.StatusDetail, v.AssignedIp, v.LastError)
	})
	return vm
}

// published fetches the guest's page through a published port, no
// keep-alive.
func published(addr string) (string, error) {
	c := &http.Client{Timeout: 3 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	r, err := c.Get("http://" + addr + "/")
	if err != nil {
		return "", err
	}
	defer r.Body.Close()
	b, err := io.ReadAll(r.Body)
	return string(b), err
}

func qemuPID(t *testing.T, agentDir, vmID string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(agentDir, "vms", vmID, "qemu.pid"))
	require.NoError(t, err, "the agent keeps its guest's QEMU pid")
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	require.NoError(t, err)
	return pid
}

// alive reports whether pid runs; a zombie (exited, not yet reaped by
// whoever inherited it) does not.
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// The state follows the command name, which ends at the last ')'.
	rest := string(b[bytes.LastIndexByte(b, ')')+1:])
	return !strings.HasPrefix(strings.TrimSpace(rest), "Z")
}

var pinRefused = regexp.MustCompile(`(?i)certificate[^\n]*(pin)`)

// newFleetRun sets up a run at base: the LAN, the image server, and the
// cleanup that kills every process the run started (logging their last
// words when the test failed).
func newFleetRun(t *testing.T, base string) *fleetRun {
	require.NotEmpty(t, base, fleetBaseEnv+" is set by the outer test")
	f := &fleetRun{bin: os.Getenv("EITRI_BIN"), base: base, logs: filepath.Join(base, "logs")}
	require.NoError(t, os.MkdirAll(f.logs, 0o755))
	t.Cleanup(func() {
		f.mu.Lock()
		procs := f.procs
		f.mu.Unlock()
		for _, p := range procs {
			if !p.exited() {
				p.kill()
			}
		}
		if t.Failed() {
			dumped := map[string]bool{}
			for _, p := range procs {
				if !dumped[p.log] {
					dumped[p.log] = true
					t.Logf("%s log %s, last lines:\n%s", p.name, p.log, tail(p.log, 40))
				}
			}
		}
	})
	f.lan(t)
	f.serveImage(t)
	usage, _ := exec.Command(f.bin, "agent", "-h").CombinedOutput()
	f.agentUsage = string(usage)
	if strings.Contains(f.agentUsage, "-accel") {
		f.accelFlags = []string{"--accel", "auto"}
	}
	return f
}

func runFleet(t *testing.T, base string) {
	f := newFleetRun(t, base)
	usage, hasAccel := f.agentUsage, len(f.accelFlags) > 0

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	serverDir := filepath.Join(base, "server")
	var token string
	f.server, f.fp, token = f.startServer(t, "server", serverDir)
	f.hc = connclient.HTTPClient(f.fp) // pinned: an imposter never answers these clients
	f.auth = connect.WithInterceptors(connclient.Bearer(token))
	f.hosts = followHosts(ctx, f.hostClient())
	vmc := eitriv1connect.NewVMServiceClient(f.hc, cpURL, f.auth)
	f.vms = followVMs(ctx, vmc)
	exps := eitriv1connect.NewExposureServiceClient(f.hc, cpURL, f.auth)

	dirs := map[string]string{"a": filepath.Join(base, "agent-a"), "b": filepath.Join(base, "agent-b")}
	agents := map[string]*proc{}
	hostIDs := map[string]string{}
	var usedToken string

	mustRun(t, "each host enrolls with a join token of its own", func(t *testing.T) {
		for _, h := range []string{"a", "b"} {
			tok := f.joinToken(t)
			if h == "a" {
				usedToken = tok
			}
			agents[h] = f.start(t, "agent-"+h, agentNS(base, h), f.agentArgs(h, dirs[h], "--join", tok)...)
		}
		for _, h := range []string{"a", "b"} {
			hostIDs[h] = f.waitEnrolled(t, h, agents[h]).Id
		}
		assert.NotEqual(t, hostIDs["a"], hostIDs["b"])
		assert.Equal(t, hostIP("a"), f.hostNamed("host-a").Address, "the host reports the address given with --address")
	})

	t.Run("a used join token enrolls nobody", func(t *testing.T) {
		out, err, running := f.runOnce(t, "agent-reuse", agentNS(base, "a"), 2*time.Minute,
			f.agentArgs("a", filepath.Join(base, "agent-reuse"), "--join", usedToken, "--name", "host-reuse", "--bridge", "eitrire0", "--subnet", "10.78.0.1/24")...)
		require.False(t, running, "an agent with a spent join token keeps running:\n%s", out)
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "it exits non-zero")
		assert.NotZero(t, ee.ExitCode())
		assert.Contains(t, out, "join token was already used", "the error says why")
		r, err := f.hostClient().ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
		require.NoError(t, err)
		var names []string
		for _, h := range r.Msg.Hosts {
			names = append(names, h.Name)
		}
		assert.ElementsMatch(t, []string{"host-a", "host-b"}, names, "nobody else enrolled")
	})

	t.Run("each host proves and reports its accelerator", func(t *testing.T) {
		assert.True(t, hasAccel, "eitri agent has an --accel flag (auto|kvm|tcg); its usage:\n%s", usage)
		for _, h := range []string{"a", "b"} {
			waitUntil(t, 30*time.Second, "host-"+h+" reports an accelerator and why", func() (bool, string) {
				x, ok := f.hosts.get(hostIDs[h])
				if !ok {
					return false, "host not in the watched list"
				}
				return (x.Accelerator == "kvm" || x.Accelerator == "tcg") && x.AcceleratorReason != "",
					fmt.Sprintf("accelerator=%q accelerator_reason=%q", x.Accelerator, x.AcceleratorReason)
			})
			x, _ := f.hosts.get(hostIDs[h])
			t.Logf("host-%s runs guests under %s: %s", h, x.Accelerator, x.AcceleratorReason)
		}
	})

	vmIDs := map[string]string{}
	mustRun(t, "a VM placed on each host reaches ready", func(t *testing.T) {
		for _, h := range []string{"a", "b"} {
			r, err := vmc.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{
				Name: "guest-" + h, HostId: hostIDs[h], ImageUrl: f.imageURL, ImageSha256: f.imageSum, Vcpus: 1, MemMb: 256, DiskGb: 1,
			}))
			require.NoError(t, err)
			assert.Equal(t, hostIDs[h], r.Msg.Vm.HostId, "placed on the host asked for")
			vmIDs[h] = r.Msg.Vm.Id
		}
		for _, h := range []string{"a", "b"} {
			vm := f.waitReady(t, vmIDs[h], 5*time.Minute, "guest-"+h+" becomes ready on host-"+h)
			assert.Equal(t, hostIDs[h], vm.HostId)
			t.Logf("guest-%s ready at %s", h, vm.AssignedIp)
		}
	})

	var exposed string
	mustRun(t, "a port published on the LAN answers from the control plane's namespace", func(t *testing.T) {
		r, err := exps.CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{VmId: vmIDs["a"], GuestPort: 80, Scope: "lan"}))
		require.NoError(t, err)
		id := r.Msg.Exposure.Id
		var x *eitriv1.Exposure
		waitUntil(t, 30*time.Second, "host-a reports the exposure active", func() (bool, string) {
			l, err := exps.ListExposures(ctx, connect.NewRequest(&eitriv1.ListExposuresRequest{VmId: vmIDs["a"]}))
			if err != nil {
				return false, err.Error()
			}
			for _, e := range l.Msg.Exposures {
				if e.Id == id {
					x = e
					if e.State == "failed" {
						t.Fatalf("the exposure failed: %s", e.Reason)
					}
					return e.State == "active" && e.HostAddr != "", fmt.Sprintf("state=%q host_addr=%q", e.State, e.HostAddr)
				}
			}
			return false, "not listed"
		})
		assert.Equal(t, hostIP("a"), x.HostAddr, "a lan exposure is reachable on its host's address")
		assert.Equal(t, hostIDs["a"], x.HostId)
		exposed = net.JoinHostPort(x.HostAddr, strconv.Itoa(int(x.HostPort)))
		var body string
		waitUntil(t, 30*time.Second, "the guest's page through "+exposed, func() (bool, string) {
			b, err := published(exposed)
			if err != nil {
				return false, err.Error()
			}
			body = b
			return strings.Contains(b, "hostname=guest-a"), b
		})
		t.Logf("%s answers: %s", exposed, strings.TrimSpace(body))
	})

	mustRun(t, "a killed agent leaves its guest running, and its restart adopts the same QEMU", func(t *testing.T) {
		pid := qemuPID(t, dirs["a"], vmIDs["a"])
		require.True(t, alive(pid), "QEMU %d runs before the kill", pid)
		agents["a"].kill()
		f.waitConnected(t, hostIDs["a"], false, 30*time.Second, "host-a shows disconnected after its agent is SIGKILLed")
		vm, err := vmc.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: vmIDs["a"]}))
		require.NoError(t, err)
		assert.NotEqual(t, "ready", vm.Msg.Vm.Lifecycle, "nobody reports on guest-a, so it is not claimed ready")
		f.waitUnreported(t, vmIDs["a"], "watchers hear that guest-a is no longer reported on")
		assert.True(t, alive(pid), "the guest's QEMU (pid %d) outlives its agent", pid)

		agents["a"] = f.start(t, "agent-a", agentNS(base, "a"), f.agentArgs("a", dirs["a"])...)
		f.waitConnected(t, hostIDs["a"], true, time.Minute, "the restarted agent connects")
		f.waitReady(t, vmIDs["a"], 2*time.Minute, "guest-a is ready again")
		assert.Equal(t, pid, qemuPID(t, dirs["a"], vmIDs["a"]), "the restarted agent adopts the same QEMU")
		assert.True(t, alive(pid), "QEMU %d still runs", pid)
		waitUntil(t, 30*time.Second, "the published port answers again through the restarted agent", func() (bool, string) {
			b, err := published(exposed)
			if err != nil {
				return false, err.Error()
			}
			return strings.Contains(b, "hostname=guest-a"), b
		})
	})

	mustRun(t, "a host whose link goes down shows disconnected within 30 s, and connected when it is back", func(t *testing.T) {
		ns := agentNS(base, "b")
		down := time.Now()
		sh(t, "ip", "-n", ns, "link", "set", "lan0", "down")
		linkUp := func() { _ = exec.Command("ip", "-n", ns, "link", "set", "lan0", "up").Run() }
		defer linkUp() // whatever happens below
		f.waitConnected(t, hostIDs["b"], false, 30*time.Second, "host-b, silent without a FIN, shows disconnected")
		t.Logf("host-b shown disconnected %s after its link went down", time.Since(down).Round(100*time.Millisecond))
		assert.False(t, agents["b"].exited(), "agent-b keeps running without its link")
		f.waitUnreported(t, vmIDs["b"], "watchers hear that guest-b is no longer reported on")
		up := time.Now()
		sh(t, "ip", "-n", ns, "link", "set", "lan0", "up")
		f.waitConnected(t, hostIDs["b"], true, 90*time.Second, "host-b reconnects once its link is up")
		t.Logf("host-b connected again %s after its link came up", time.Since(up).Round(100*time.Millisecond))
		f.waitReady(t, vmIDs["b"], time.Minute, "guest-b is reported ready again")
	})

	mustRun(t, "an agent restarted while the control plane is down serves its published port again at once", func(t *testing.T) {
		f.server.stop(t)
		agents["a"].kill()
		_, err := published(exposed)
		require.Error(t, err, "the port went with the killed agent")

		// No control plane to answer: the port comes back from the agent's
		// own records, and reaches the guest the killed agent left running.
		agents["a"] = f.start(t, "agent-a", agentNS(base, "a"), f.agentArgs("a", dirs["a"])...)
		waitUntil(t, time.Minute, "the published port answers through the restarted agent, control plane down", func() (bool, string) {
			if agents["a"].exited() {
				t.Fatalf("agent-a exited: %v", agents["a"].err)
			}
			b, err := published(exposed)
			if err != nil {
				return false, err.Error()
			}
			return strings.Contains(b, "hostname=guest-a"), b
		})

		var fp string
		f.server, fp, _ = f.startServer(t, "server", serverDir)
		require.Equal(t, f.fp, fp)
		for _, h := range []string{"a", "b"} {
			f.waitConnected(t, hostIDs[h], true, 90*time.Second, "host-"+h+" connects to the control plane again")
		}
		f.waitReady(t, vmIDs["a"], time.Minute, "guest-a is reported ready again")
		_, err = published(exposed)
		assert.NoError(t, err, "the port stays up once the snapshot replaces the restored one")
	})

	mustRun(t, "an imposter control plane with another certificate gets no agent", func(t *testing.T) {
		offsets := map[string]int64{"a": agents["a"].logSize(), "b": agents["b"].logSize()}
		f.server.stop(t)
		imposter, impFP, impToken := f.startServer(t, "imposter", filepath.Join(base, "imposter"))
		require.NotEqual(t, f.fp, impFP, "the imposter made a certificate of its own")
		for _, h := range []string{"a", "b"} {
			// Evidence that the agent tried and turned the imposter down:
			// its own log says the certificate is not the pinned one, or
			// the imposter saw the agent abort the TLS handshake.
			refusedFrom := regexp.MustCompile(`handshake error from ` + regexp.QuoteMeta(hostIP(h)) + `:\d+: remote error: tls: bad certificate`)
			waitUntil(t, time.Minute, "agent-"+h+" refuses the imposter's certificate", func() (bool, string) {
				own := agents[h].logSince(offsets[h])
				if pinRefused.MatchString(own) {
					return true, ""
				}
				return refusedFrom.MatchString(imposter.logSince(0)),
					"agent says:\n" + lastLines(own, 3) + "\nimposter says:\n" + lastLines(imposter.logSince(0), 3)
			})
			if !pinRefused.MatchString(agents[h].logSince(offsets[h])) {
				t.Logf("agent-%s does not say why it refused the imposter; its last words: %s", h, lastLines(agents[h].logSince(offsets[h]), 1))
			}
		}
		impHosts := eitriv1connect.NewHostServiceClient(connclient.HTTPClient(impFP), cpURL,
			connect.WithInterceptors(connclient.Bearer(impToken)))
		r, err := impHosts.ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
		require.NoError(t, err)
		for _, h := range r.Msg.Hosts {
			assert.False(t, h.Connected, "host %s (%s) has a stream open with the imposter", h.Name, h.Id)
		}
		assert.Empty(t, r.Msg.Hosts, "the imposter knows no host")
		imposter.stop(t)

		var fp string
		f.server, fp, _ = f.startServer(t, "server", serverDir)
		require.Equal(t, f.fp, fp, "the real control plane keeps its certificate across a restart")
		for _, h := range []string{"a", "b"} {
			f.waitConnected(t, hostIDs[h], true, 90*time.Second, "host-"+h+" connects to the real control plane again")
		}
		for _, h := range []string{"a", "b"} {
			f.waitReady(t, vmIDs[h], time.Minute, "guest-"+h+" is reported ready again")
		}
	})

	t.Run("a second agent on the same data dir refuses to start, naming the pid holding it", func(t *testing.T) {
		running := agents["a"]
		require.False(t, running.exited(), "agent-a runs")
		out, err, stillRunning := f.runOnce(t, "agent-a-second", agentNS(base, "a"), time.Minute,
			f.agentArgs("a", dirs["a"], "--bridge", "eitri2nd0", "--subnet", "10.79.0.1/24")...)
		require.False(t, stillRunning, "a second agent on %s kept running beside pid %d:\n%s", dirs["a"], running.pid(), out)
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "it exits non-zero:\n%s", out)
		assert.NotZero(t, ee.ExitCode())
		assert.Regexp(t, `\b`+strconv.Itoa(running.pid())+`\b`, out, "the error names the pid of the agent holding the data dir")
		assert.False(t, running.exited(), "the first agent keeps running")
		f.waitConnected(t, hostIDs["a"], true, 10*time.Second, "host-a stays connected")
	})
}

// table is the latest state of each object a watch stream has sent; it is
// emptied while the stream is down, so a stale row is never read as fresh.
type table[T any] struct {
	mu   sync.Mutex
	rows map[string]T
}

func (tb *table[T]) get(id string) (T, bool) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	v, ok := tb.rows[id]
	return v, ok
}

func (tb *table[T]) all() []T {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	out := make([]T, 0, len(tb.rows))
	for _, v := range tb.rows {
		out = append(out, v)
	}
	return out
}

func (tb *table[T]) reset(rows []T, key func(T) string) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	tb.rows = map[string]T{}
	for _, r := range rows {
		tb.rows[key(r)] = r
	}
}

func (tb *table[T]) set(id string, v T, removed bool) {
	tb.mu.Lock()
	defer tb.mu.Unlock()
	if removed {
		delete(tb.rows, id)
		return
	}
	tb.rows[id] = v
}

// follow keeps a watch stream open until ctx ends, reopening it when it
// breaks (the control plane restarts in this test).
func follow[R any, T any](ctx context.Context, key func(T) string,
	open func(context.Context) (*connect.ServerStreamForClient[R], error),
	event func(*R) (snapshot []T, isSnapshot bool, changed T, removedID string)) *table[T] {
	tb := &table[T]{rows: map[string]T{}}
	go func() {
		for ctx.Err() == nil {
			if s, err := open(ctx); err == nil {
				for s.Receive() {
					snap, isSnap, changed, removed := event(s.Msg())
					switch {
					case isSnap:
						tb.reset(snap, key)
					case removed != "":
						tb.set(removed, changed, true)
					default:
						tb.set(key(changed), changed, false)
					}
				}
				s.Close()
			}
			tb.reset(nil, key)
			select {
			case <-ctx.Done():
			case <-time.After(250 * time.Millisecond):
			}
		}
	}()
	return tb
}

func followHosts(ctx context.Context, c eitriv1connect.HostServiceClient) *table[*eitriv1.Host] {
	return follow(ctx, (*eitriv1.Host).GetId,
		func(ctx context.Context) (*connect.ServerStreamForClient[eitriv1.WatchHostsResponse], error) {
			return c.WatchHosts(ctx, connect.NewRequest(&eitriv1.WatchHostsRequest{}))
		},
		func(m *eitriv1.WatchHostsResponse) ([]*eitriv1.Host, bool, *eitriv1.Host, string) {
			if s := m.GetSnapshot(); s != nil {
				return s.GetHosts(), true, nil, ""
			}
			return nil, false, m.GetChanged(), m.GetRemovedId()
		})
}

// followVMs follows the VMs; note, if given, is shown every message as
// it arrives.
func followVMs(ctx context.Context, c eitriv1connect.VMServiceClient, note ...func(*eitriv1.WatchVMsResponse)) *table[*eitriv1.VM] {
	return follow(ctx, (*eitriv1.VM).GetId,
		func(ctx context.Context) (*connect.ServerStreamForClient[eitriv1.WatchVMsResponse], error) {
			return c.WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
		},
		func(m *eitriv1.WatchVMsResponse) ([]*eitriv1.VM, bool, *eitriv1.VM, string) {
			for _, n := range note {
				n(m)
			}
			if s := m.GetSnapshot(); s != nil {
				return s.GetVms(), true, nil, ""
			}
			return nil, false, m.GetChanged(), m.GetRemovedId()
		})
}

// waitUntil polls check until it holds, and fails the test with what was
// last seen when it does not within the deadline (or a minute before the
// test binary's own deadline, so cleanups still run).
func waitUntil(t *testing.T, within time.Duration, what string, check func() (bool, string)) {
	t.Helper()
	start := time.Now()
	deadline := start.Add(within)
	if d, ok := t.Deadline(); ok && d.Add(-time.Minute).Before(deadline) {
		deadline = d.Add(-time.Minute)
	}
	for {
		ok, state := check()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not so after %s; last seen: %s", what, time.Since(start).Round(time.Second), state)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func tail(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	return lastLines(string(b), n)
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
