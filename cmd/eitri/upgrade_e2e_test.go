package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// The upgrade tests build the agent twice from this source, as build A and
// build B, told apart only by the version they are linked with, and upgrade
// two agents in network namespaces of their own (the fleet test's LAN) from
// A to B through the control plane.
const (
	versionA = "v1.3.0-e2e"
	versionB = "v1.4.0-e2e"
)

func TestTwoAgentsUpgradeFromBuildAToBuildBWithoutTouchingAGuest(t *testing.T) {
	fleetTest(t, 15*time.Minute, "a control plane and two agents upgrading, each in its own network namespace", runUpgrade)
}

func TestACanaryThatExitsAtStartIsRolledBackAndTheRolloutHalts(t *testing.T) {
	fleetTest(t, 10*time.Minute, "a control plane and two agents, one upgraded to a build that exits at start", runBrokenUpgrade)
}

// upgradeRun is a fleet run with a release key and the CLI pointed at its
// control plane.
type upgradeRun struct {
	*fleetRun
	keys string // release.key and release.pub
	env  []string
	rel  eitriv1connect.ReleaseServiceClient
}

// buildAs builds eitri from this source linked as version into path.
func buildAs(t *testing.T, version, path string) {
	t.Helper()
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	cmd := exec.Command("go", "build", "-ldflags", "-X main.version="+version, "-o", path, "./cmd/eitri")
	cmd.Dir = root
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build %s: %s", version, out)
}

// cli runs an eitri client command line against the run's control plane
// and returns its output.
func (u *upgradeRun) cli(t *testing.T, bin string, args ...string) string {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = u.env
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "eitri %s: %s", strings.Join(args, " "), out)
	return string(out)
}

// newUpgradeRun starts the control plane with a fresh release key, and
// hosts a and b each running their own copy of build A (an upgrade
// replaces the binary it runs from).
func newUpgradeRun(t *testing.T, base string) (u *upgradeRun, buildA string, dirs, hostIDs map[string]string, agents map[string]*proc) {
	f := newFleetRun(t, base)
	u = &upgradeRun{fleetRun: f, keys: filepath.Join(base, "keys")}
	buildA = filepath.Join(base, "builds", "eitri-a")
	buildAs(t, versionA, buildA)
	out, err := exec.Command(buildA, "release", "keygen", "--dir", u.keys).CombinedOutput()
	require.NoError(t, err, "%s", out)

	serverDir := filepath.Join(base, "server")
	var token string
	f.server, f.fp = f.startServing(t, "server", cpIP+":"+cpPort,
		append(f.serverArgs(serverDir), "--release-key", filepath.Join(u.keys, "release.pub"))...)
	b, err := os.ReadFile(filepath.Join(serverDir, "admin.token"))
	require.NoError(t, err)
	token = strings.TrimSpace(string(b))
	f.hc = connclient.HTTPClient(f.fp)
	f.auth = connect.WithInterceptors(connclient.Bearer(token))
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	f.hosts = followHosts(ctx, f.hostClient())
	f.vms = followVMs(ctx, eitriv1connect.NewVMServiceClient(f.hc, cpURL, f.auth))
	u.rel = eitriv1connect.NewReleaseServiceClient(f.hc, cpURL, f.auth)
	u.env = append(os.Environ(), "EITRI_URL="+cpURL, "EITRI_TOKEN="+token, "EITRI_FINGERPRINT="+f.fp,
		"XDG_CONFIG_HOME="+filepath.Join(base, "config"))

	dirs, hostIDs, agents = map[string]string{}, map[string]string{}, map[string]*proc{}
	for _, h := range []string{"a", "b"} {
		dirs[h] = filepath.Join(base, "agent-"+h)
		exe := filepath.Join(base, "host-"+h, "bin", "eitri")
		require.NoError(t, os.MkdirAll(filepath.Dir(exe), 0o755))
		data, err := os.ReadFile(buildA)
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(exe, data, 0o755))
		argv := append([]string{"ip", "netns", "exec", agentNS(base, h), exe}, f.agentArgs(h, dirs[h], "--join", f.joinToken(t))...)
		agents[h] = startProc(t, f.logs, "agent-"+h, argv...)
		f.mu.Lock()
		f.procs = append(f.procs, agents[h])
		f.mu.Unlock()
	}
	for _, h := range []string{"a", "b"} {
		x := f.waitEnrolled(t, h, agents[h])
		hostIDs[h] = x.Id
		assert.Equal(t, versionA, x.AgentVersion)
	}
	return u, buildA, dirs, hostIDs, agents
}

// waitVersion waits until host id runs version, connected.
func (u *upgradeRun) waitVersion(t *testing.T, id, version string, within time.Duration, why string) {
	t.Helper()
	waitUntil(t, within, why, func() (bool, string) {
		h, ok := u.hosts.get(id)
		if !ok {
			return false, "host not in the watched list"
		}
		return h.Connected && h.AgentVersion == version, fmt.Sprintf("connected=%v version=%q upgrade=%v conditions=%v",
			h.Connected, h.AgentVersion, h.Upgrade, h.Conditions)
	})
}

// narration collects every upgrade sentence the hosts said, as watchers
// saw them.
type narration struct {
	mu   sync.Mutex
	seen map[string][]string // host id → distinct details, in order
}

func (n *narration) follow(ctx context.Context, u *upgradeRun) {
	n.seen = map[string][]string{}
	go func() {
		for ctx.Err() == nil {
			for _, h := range u.hosts.all() {
				d := h.GetUpgrade().GetDetail()
				n.mu.Lock()
				if l := n.seen[h.Id]; d != "" && (len(l) == 0 || l[len(l)-1] != d) {
					n.seen[h.Id] = append(l, d)
				}
				n.mu.Unlock()
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
}

func (n *narration) of(id string) []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]string(nil), n.seen[id]...)
}

// prober asks a published port for the guest's page every 100 ms and keeps
// the longest run of failures.
type prober struct {
	mu           sync.Mutex
	ok, failed   int
	longest, run time.Duration
	lastErr      string
	since        time.Time
	failing      bool
}

func (p *prober) start(ctx context.Context, addr, want string) {
	go func() {
		for ctx.Err() == nil {
			b, err := published(addr)
			now := time.Now()
			p.mu.Lock()
			if err == nil && strings.Contains(b, want) {
				p.ok++
				p.failing = false
			} else {
				p.failed++
				if err != nil {
					p.lastErr = err.Error()
				}
				if !p.failing {
					p.failing, p.since = true, now
				}
				p.longest = max(p.longest, now.Sub(p.since))
			}
			p.mu.Unlock()
			time.Sleep(100 * time.Millisecond)
		}
	}()
}

func (p *prober) report() (ok, failed int, longest time.Duration, lastErr string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ok, p.failed, p.longest, p.lastErr
}

func runUpgrade(t *testing.T, base string) {
	u, _, dirs, hostIDs, _ := newUpgradeRun(t, base)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	vmc := eitriv1connect.NewVMServiceClient(u.hc, cpURL, u.auth)
	exps := eitriv1connect.NewExposureServiceClient(u.hc, cpURL, u.auth)

	vmIDs, pids, exposed := map[string]string{}, map[string]int{}, map[string]string{}
	mustRun(t, "a guest on each host answers on a published port", func(t *testing.T) {
		for _, h := range []string{"a", "b"} {
			r, err := vmc.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{
				Name: "guest-" + h, HostId: hostIDs[h], ImageUrl: u.imageURL, ImageSha256: u.imageSum, Vcpus: 1, MemMb: 256, DiskGb: 1,
			}))
			require.NoError(t, err)
			vmIDs[h] = r.Msg.Vm.Id
		}
		for _, h := range []string{"a", "b"} {
			u.waitReady(t, vmIDs[h], 5*time.Minute, "guest-"+h+" becomes ready")
			pids[h] = qemuPID(t, dirs[h], vmIDs[h])
			r, err := exps.CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{VmId: vmIDs[h], GuestPort: 80, Scope: "lan"}))
			require.NoError(t, err)
			exposed[h] = net.JoinHostPort(hostIP(h), strconv.Itoa(int(r.Msg.Exposure.HostPort)))
			waitUntil(t, time.Minute, "guest-"+h+"'s page through "+exposed[h], func() (bool, string) {
				b, err := published(exposed[h])
				if err != nil {
					return false, err.Error()
				}
				return strings.Contains(b, "hostname=guest-"+h), b
			})
		}
	})

	buildB := filepath.Join(base, "builds", "eitri-b")
	mustRun(t, "build B is signed and uploaded", func(t *testing.T) {
		buildAs(t, versionB, buildB)
		out := u.cli(t, buildB, "release", "sign", buildB, "--key", filepath.Join(u.keys, "release.key"))
		assert.Contains(t, out, versionB, "the version is read from the binary")
		out = u.cli(t, buildB, "release", "upload", buildB)
		assert.Contains(t, out, versionB)
		out = u.cli(t, buildB, "release", "ls")
		assert.Contains(t, out, versionB)
		assert.Contains(t, out, "linux/amd64")
	})

	probes := map[string]*prober{}
	var said narration
	said.follow(ctx, u)
	for _, h := range []string{"a", "b"} {
		probes[h] = &prober{}
		probes[h].start(ctx, exposed[h], "hostname=guest-"+h)
	}
	mustRun(t, "eitri host upgrade takes both hosts to build B", func(t *testing.T) {
		out := u.cli(t, buildB, "host", "upgrade", "--to", versionB, "--all", "--max-unavailable", "1")
		assert.Contains(t, out, "canary")
		for _, h := range []string{"a", "b"} {
			u.waitVersion(t, hostIDs[h], versionB, 5*time.Minute, "host-"+h+" reconnects as "+versionB)
		}
		waitUntil(t, time.Minute, "the rollout is done", func() (bool, string) {
			r, err := u.rel.GetRollout(ctx, connect.NewRequest(&eitriv1.GetRolloutRequest{}))
			if err != nil {
				return false, err.Error()
			}
			return r.Msg.Rollout.State == "done", fmt.Sprintf("%v", r.Msg.Rollout)
		})
		t.Log(u.cli(t, buildB, "host", "upgrade", "status"))
	})

	t.Run("every guest keeps its QEMU and its published port", func(t *testing.T) {
		for _, h := range []string{"a", "b"} {
			u.waitReady(t, vmIDs[h], 2*time.Minute, "guest-"+h+" is reported ready by build B")
			assert.Equal(t, pids[h], qemuPID(t, dirs[h], vmIDs[h]), "build B adopted guest-%s's QEMU", h)
			assert.True(t, alive(pids[h]), "QEMU %d of guest-%s never stopped", pids[h], h)
			waitUntil(t, 30*time.Second, "guest-"+h+"'s port answers after the upgrade", func() (bool, string) {
				b, err := published(exposed[h])
				if err != nil {
					return false, err.Error()
				}
				return strings.Contains(b, "hostname=guest-"+h), b
			})
			ok, failed, longest, lastErr := probes[h].report()
			t.Logf("guest-%s's port through the upgrade: %d answers, %d failures, longest pause %s (%s)", h, ok, failed, longest.Round(100*time.Millisecond), lastErr)
			assert.Greater(t, ok, 0)
			assert.Less(t, longest, 15*time.Second, "the published port pauses briefly, at most")
		}
	})

	t.Run("each host narrated its upgrade and says it is done", func(t *testing.T) {
		for _, h := range []string{"a", "b"} {
			// The rollout is done once each host has reconnected as build B;
			// the host says it is done once it has also applied a snapshot,
			// a moment later, in its next report.
			waitUntil(t, 30*time.Second, "host-"+h+" says its upgrade is done", func() (bool, string) {
				x, _ := u.hosts.get(hostIDs[h])
				return x.GetUpgrade().GetStep() == "done", x.GetUpgrade().GetStep() + ": " + x.GetUpgrade().GetDetail()
			})
			seen := strings.Join(said.of(hostIDs[h]), " | ")
			t.Logf("host-%s said: %s", h, seen)
			assert.Contains(t, seen, "reconnected as "+versionB)
			x, _ := u.hosts.get(hostIDs[h])
			assert.False(t, x.GetAgentUpdateAvailable(), "nothing newer is held")
		}
		prev, err := os.ReadFile(filepath.Join(dirs["a"], "upgrade", "eitri.previous"))
		require.NoError(t, err, "the previous build is kept")
		a, err := os.ReadFile(filepath.Join(base, "builds", "eitri-a"))
		require.NoError(t, err)
		assert.Equal(t, a, prev)
	})
}

func runBrokenUpgrade(t *testing.T, base string) {
	u, _, _, hostIDs, _ := newUpgradeRun(t, base)
	ctx := context.Background()

	// Build B says its version when asked, and exits as soon as it is
	// started as an agent.
	broken := filepath.Join(base, "builds", "eitri-broken")
	require.NoError(t, os.WriteFile(broken, []byte("#!/bin/sh\nif [ \"$1\" = version ]; then echo 'eitri version "+versionB+"'; exit 0; fi\necho 'build B: exiting at start' >&2\nexit 3\n"), 0o755))
	buildA := filepath.Join(base, "builds", "eitri-a")
	u.cli(t, buildA, "release", "sign", broken, "--key", filepath.Join(u.keys, "release.key"), "--version", versionB, "--os", "linux", "--arch", "amd64")
	u.cli(t, buildA, "release", "upload", broken)

	r, err := u.rel.StartRollout(ctx, connect.NewRequest(&eitriv1.StartRolloutRequest{Version: versionB, All: true}))
	require.NoError(t, err)
	canary := r.Msg.Rollout.Hosts[0].HostId
	other := hostIDs["a"]
	if other == canary {
		other = hostIDs["b"]
	}

	var halted *eitriv1.Rollout
	waitUntil(t, 3*time.Minute, "the rollout halts on the canary", func() (bool, string) {
		r, err := u.rel.GetRollout(ctx, connect.NewRequest(&eitriv1.GetRolloutRequest{Id: r.Msg.Rollout.Id}))
		if err != nil {
			return false, err.Error()
		}
		halted = r.Msg.Rollout
		return halted.State == "halted", fmt.Sprintf("%v", halted)
	})
	assert.Contains(t, halted.Reason, "exited before it reconnected")
	u.waitVersion(t, canary, versionA, time.Minute, "the canary is back on build A, by itself")
	// The host reconnects on build A a moment before it reports the failed
	// upgrade; the watched row gets the two as separate events.
	waitUntil(t, 30*time.Second, "the watched canary row says its upgrade failed", func() (bool, string) {
		x, _ := u.hosts.get(canary)
		return x.GetUpgrade().GetStep() == "failed", fmt.Sprintf("upgrade=%v", x.GetUpgrade())
	})
	x, _ := u.hosts.get(canary)
	assert.Contains(t, x.GetUpgrade().GetError(), "rolled back to "+versionA, "the host says what failed")

	for _, h := range halted.Hosts {
		if h.HostId == other {
			assert.Equal(t, "pending", h.State, "the second host is untouched")
		}
	}
	y, _ := u.hosts.get(other)
	assert.Equal(t, versionA, y.AgentVersion)
	assert.Nil(t, y.GetUpgrade(), "the second host was never offered the build")
	t.Log(u.cli(t, buildA, "host", "ls"))
}
