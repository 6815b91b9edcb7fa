package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
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
	"github.com/a73x/eitri/server/store/pgtest"
	"github.com/a73x/eitri/wire/connclient"
)

// The replicas' fleet test is the fleet test's LAN with the control plane
// made of three eitri server processes on one PostgreSQL, all in the test's
// namespace:
//
//	PostgreSQL     a unix socket in a directory of its own
//	replica 1      https://192.168.77.1:7443   (host-a enrolls through it)
//	replica 2      https://192.168.77.1:7444   (the watcher)
//	replica 3      https://192.168.77.1:7445   (host-b enrolls through it)
//	host-a         192.168.77.11
//	host-b         192.168.77.12
func TestThreeReplicasOnPostgreSQLKeepAFleetThroughAReplicaKillADatabaseRestartAndRollingRestarts(t *testing.T) {
	fleetTest(t, 8*time.Minute, "PostgreSQL, three control-plane replicas and two agents, each agent in its own network namespace", runReplicaFleet)
}

// replicaProc is one replica of the run: its address, the arguments it is
// (re)started with, and its current process.
type replicaProc struct {
	name, addr, url, dir string
	publicURLs           []string // its own first
	args                 []string
	p                    *proc
}

func (r *replicaProc) start(t *testing.T, f *fleetRun) {
	t.Helper()
	r.p = f.start(t, r.name, "", r.args...)
}

// hostConnectedRE matches a replica's log line for a stream of the host
// opened there.
func hostConnectedRE(hostID string) *regexp.Regexp {
	return regexp.MustCompile(`msg="host connected" host=` + regexp.QuoteMeta(hostID) + `\b`)
}

// vmLog is what one WatchVMs stream (reopened as follow does) received, in
// arrival order.
type vmLog struct {
	mu        sync.Mutex
	snapshots []map[string]*eitriv1.VM // the first message of each stream opened
	seen      []*eitriv1.VM            // every VM sent, snapshots' rows included
}

func (l *vmLog) note(m *eitriv1.WatchVMsResponse) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s := m.GetSnapshot(); s != nil {
		snap := map[string]*eitriv1.VM{}
		for _, v := range s.GetVms() {
			snap[v.Id] = v
			l.seen = append(l.seen, v)
		}
		l.snapshots = append(l.snapshots, snap)
		return
	}
	if v := m.GetChanged(); v != nil {
		l.seen = append(l.seen, v)
	}
}

// opened is how many streams were opened (each begins with a snapshot).
func (l *vmLog) opened() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.snapshots)
}

func (l *vmLog) snapshot(n int) map[string]*eitriv1.VM {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.snapshots[n]
}

// of is what was received of one VM, in arrival order.
func (l *vmLog) of(id string) []*eitriv1.VM {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []*eitriv1.VM
	for _, v := range l.seen {
		if v.Id == id {
			out = append(out, v)
		}
	}
	return out
}

func vmWords(v *eitriv1.VM) string {
	return fmt.Sprintf("lifecycle=%q detail=%q ip=%q last_error=%q", v.Lifecycle, v.StatusDetail, v.AssignedIp, v.LastError)
}

func runReplicaFleet(t *testing.T, base string) {
	if _, err := exec.LookPath("ss"); err != nil {
		t.Skip("ss not installed (iproute2, which make deps installs, has it)")
	}
	pg, err := pgtest.Start()
	if errors.Is(err, pgtest.ErrNoPostgres) {
		t.Skipf("PostgreSQL is not installed: %s", pgtest.InstallHint)
	}
	require.NoError(t, err, "start PostgreSQL")
	require.NoError(t, os.WriteFile(filepath.Join(base, elsewhereFile), []byte(pg.Dir+"\n"), 0o644))
	t.Cleanup(func() { // after the replicas are killed: cleanups run last first
		if t.Failed() {
			copyFile(filepath.Join(pg.Dir, "postgres.log"), filepath.Join(base, "logs", "postgres.log"))
		}
		assert.NoError(t, pg.Stop())
	})
	f := newFleetRun(t, base)
	db, err := pg.CreateDatabase(context.Background(), "")
	require.NoError(t, err)
	dsn := pg.DSN(db)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	rs := make([]*replicaProc, 3)
	var urls []string
	for i := range rs {
		addr := cpIP + ":" + strconv.Itoa(7443+i)
		urls = append(urls, "https://"+addr)
		rs[i] = &replicaProc{name: fmt.Sprintf("replica-%d", i+1), addr: addr, url: urls[i], dir: filepath.Join(base, fmt.Sprintf("replica-%d", i+1))}
	}
	require.Equal(t, cpURL, rs[0].url, "replica 1 answers where the fleet test's helpers call")
	for i, r := range rs {
		r.publicURLs = append([]string{r.url}, slices.Delete(slices.Clone(urls), i, i+1)...)
		r.args = []string{"server", "--db", dsn, "--data-dir", r.dir, "--listen", r.addr, "--tls-hosts", cpIP,
			"--public-url", strings.Join(r.publicURLs, ","), "--advertise-url", r.url, "--delete-grace", "1m"}
	}
	vmsAt := func(r *replicaProc) eitriv1connect.VMServiceClient {
		return eitriv1connect.NewVMServiceClient(f.hc, r.url, f.auth)
	}

	dirs := map[string]string{"a": filepath.Join(base, "agent-a"), "b": filepath.Join(base, "agent-b")}
	agents := map[string]*proc{}
	hostIDs := map[string]string{}
	mustRun(t, "the first replica makes the fleet's identity, and two more started together share it", func(t *testing.T) {
		var fp string
		rs[0].p, fp = f.startServing(t, rs[0].name, rs[0].addr, rs[0].args...)
		b, err := os.ReadFile(filepath.Join(rs[0].dir, "admin.token"))
		require.NoError(t, err, "the first replica makes the first admin and writes its token to <data-dir>/admin.token")
		f.fp, f.hc = fp, connclient.HTTPClient(fp)
		f.auth = connect.WithInterceptors(connclient.Bearer(strings.TrimSpace(string(b))))
		for _, r := range rs[1:] {
			r.start(t, f)
		}
		for _, r := range rs[1:] {
			assert.Equal(t, fp, waitServing(t, r.p, r.addr), "%s presents the certificate the first made", r.name)
			_, err := os.Stat(filepath.Join(r.dir, "admin.token"))
			assert.True(t, os.IsNotExist(err), "%s made no admin of its own", r.name)
			_, err = vmsAt(r).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
			assert.NoError(t, err, "the first admin's token works on %s", r.name)
		}
		// Views that outlive any one replica, for the fleet test's helpers.
		hc, u, err := connclient.Replicas(fp, urls)
		require.NoError(t, err)
		f.hosts = followHosts(ctx, eitriv1connect.NewHostServiceClient(hc, u, f.auth))
		f.vms = followVMs(ctx, eitriv1connect.NewVMServiceClient(hc, u, f.auth))
	})

	mustRun(t, "host-a enrolls through replica 1 and host-b through replica 3, each streaming to the replica it enrolled through", func(t *testing.T) {
		for h, r := range map[string]*replicaProc{"a": rs[0], "b": rs[2]} {
			tok := f.joinTokenFrom(t, r.url, r.publicURLs)
			agents[h] = f.start(t, "agent-"+h, agentNS(base, h), f.agentArgs(h, dirs[h], "--join", tok)...)
		}
		for h, r := range map[string]*replicaProc{"a": rs[0], "b": rs[2]} {
			x := f.waitEnrolled(t, h, agents[h])
			hostIDs[h] = x.Id
			// The agent proves its accelerator before it connects, and says which in its hello.
			require.NotEmpty(t, x.Accelerator, "host-%s names its accelerator", h)
			assert.Regexp(t, hostConnectedRE(hostIDs[h]), r.p.logSince(0), "host-%s's stream is on %s, the first URL of its join token", h, r.name)
			t.Logf("host-%s runs guests under %s: %s", h, x.Accelerator, x.AcceleratorReason)
		}
	})

	// w2 watches through replica 2 alone; w3 through replica 3 first,
	// failing over to replica 1.
	w2, w3 := &vmLog{}, &vmLog{}
	followVMs(ctx, vmsAt(rs[1]), w2.note)
	hc3, u3, err := connclient.Replicas(f.fp, []string{rs[2].url, rs[0].url})
	require.NoError(t, err)
	t3 := followVMs(ctx, eitriv1connect.NewVMServiceClient(hc3, u3, f.auth), w3.note)

	var vmID string // the guest on host-b, running from here on
	mustRun(t, "replica 3 killed while host-b boots a VM made through replica 1: the agent moves, the create finishes, and watchers see it through", func(t *testing.T) {
		waitUntil(t, 10*time.Second, "the watchers on replicas 2 and 3 are open", func() (bool, string) {
			return w2.opened() > 0 && w3.opened() > 0, fmt.Sprintf("streams opened: %d, %d", w2.opened(), w3.opened())
		})
		opened2, opened3 := w2.opened(), w3.opened()
		// The kill must land after the guest's QEMU started and before it
		// is ready: a boot under TCG takes far longer than a watcher takes
		// to hear "booting", but a second VM is made should one not.
		midBoot := []string{"booting", "waiting for an address", "waiting for the guest to finish booting"}
		for attempt := 1; ; attempt++ {
			r, err := vmsAt(rs[0]).CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{
				Name: fmt.Sprintf("guest-b%d", attempt), HostId: hostIDs["b"], ImageUrl: f.imageURL, ImageSha256: f.imageSum,
				Vcpus: 1, MemMb: 256, DiskGb: 1,
			}))
			require.NoError(t, err)
			require.Equal(t, hostIDs["b"], r.Msg.Vm.HostId, "placed on the host asked for")
			id := r.Msg.Vm.Id
			var last *eitriv1.VM
			waitUntil(t, 3*time.Minute, "replica 2's watcher hears the guest boot", func() (bool, string) {
				seen := w2.of(id)
				if len(seen) == 0 {
					return false, "nothing heard of it"
				}
				last = seen[len(seen)-1]
				if last.Lifecycle == "failed" {
					t.Fatalf("the VM failed: %s", last.LastError)
				}
				return last.Lifecycle == "ready" || last.Lifecycle == "creating" && slices.Contains(midBoot, last.StatusDetail), vmWords(last)
			})
			if last.Lifecycle != "ready" {
				vmID = id
				break
			}
			require.Less(t, attempt, 2, "the guests were ready before a watcher heard them boot: no create to kill a replica during")
			t.Logf("%s was ready before a replica could be killed during its create; making another", id)
		}
		offsets := []int64{rs[0].p.logSize(), rs[1].p.logSize()}
		killed := time.Now()
		rs[2].p.kill()
		t.Logf("SIGKILLed replica 3 while the guest was %s", vmWords(w2.of(vmID)[len(w2.of(vmID))-1]))

		movedTo := ""
		waitUntil(t, 15*time.Second, "host-b's agent is connected through replica 1 or 2 within 15 s of the kill", func() (bool, string) {
			for i, r := range rs[:2] {
				if hostConnectedRE(hostIDs["b"]).MatchString(r.p.logSince(offsets[i])) {
					movedTo = r.name
				}
			}
			if movedTo == "" {
				return false, "no replica says host-b connected"
			}
			for _, r := range rs[:2] {
				ctx, done := context.WithTimeout(ctx, 5*time.Second)
				defer done()
				h, err := eitriv1connect.NewHostServiceClient(f.hc, r.url, f.auth).GetHost(ctx, connect.NewRequest(&eitriv1.GetHostRequest{Id: hostIDs["b"]}))
				if err != nil {
					return false, r.name + ": " + err.Error()
				}
				if !h.Msg.Host.Connected || h.Msg.Host.Capacity == nil {
					return false, fmt.Sprintf("%s says connected=%v capacity=%v", r.name, h.Msg.Host.Connected, h.Msg.Host.Capacity)
				}
			}
			return true, ""
		})
		t.Logf("host-b connected through %s %s after the kill (its agent's connections: %q)", movedTo, time.Since(killed).Round(10*time.Millisecond), agentPeers(t, base, "b"))

		f.waitReady(t, vmID, 4*time.Minute, "the guest whose create replica 3's death interrupted becomes ready")
		waitUntil(t, 10*time.Second, "replica 2's watcher hears it ready", func() (bool, string) {
			seen := w2.of(vmID)
			last := seen[len(seen)-1]
			return last.Lifecycle == "ready" && last.AssignedIp != "", vmWords(last)
		})
		assert.Equal(t, opened2, w2.opened(), "replica 2's watch stream stayed open throughout")
		var details, lifecycles []string
		for _, v := range w2.of(vmID) {
			if len(lifecycles) == 0 || lifecycles[len(lifecycles)-1] != v.Lifecycle {
				lifecycles = append(lifecycles, v.Lifecycle)
			}
			if v.Lifecycle == "creating" && v.StatusDetail != "" && (len(details) == 0 || details[len(details)-1] != v.StatusDetail) {
				details = append(details, v.StatusDetail)
			}
		}
		t.Logf("replica 2's watcher heard lifecycles %q, narration %q", lifecycles, details)
		assertNarratedInOrder(t, details, append(slices.Clone(createNarration),
			narrationStep{is: func(d string) bool { return d == "waiting for an address" }},
			narrationStep{is: func(d string) bool { return d == "waiting for the guest to finish booting" }}))
		if i := slices.Index(lifecycles, "ready"); assert.GreaterOrEqual(t, i, 0) {
			assert.NotContains(t, lifecycles[i:], "creating", "once ready, the create is not heard again: %q", lifecycles)
		}

		waitUntil(t, 30*time.Second, "the watcher that was on replica 3 reopens its stream on replica 1", func() (bool, string) {
			return w3.opened() > opened3, fmt.Sprintf("streams opened: %d", w3.opened())
		})
		v, ok := w3.snapshot(opened3)[vmID]
		require.True(t, ok, "the reopened stream's snapshot has the VM")
		t.Logf("the reopened watcher's snapshot: %s", vmWords(v))
		waitUntil(t, 30*time.Second, "the reopened watcher has the VM ready", func() (bool, string) {
			v, ok := t3.get(vmID)
			if !ok {
				return false, "not in its table"
			}
			return v.Lifecycle == "ready" && v.AssignedIp != "", vmWords(v)
		})

		offset := rs[2].p.logSize()
		rs[2].start(t, f)
		assert.Equal(t, f.fp, waitServing(t, rs[2].p, rs[2].addr), "replica 3 comes back with the fleet's certificate")
		assert.NotContains(t, rs[2].p.logSince(offset), "First start", "and makes no admin")
	})

	pid := 0
	var vm2 string
	mustRun(t, "PostgreSQL restarts under the replicas: they reconnect by themselves, keep everything, and a create through replica 2 is carried out on host-a", func(t *testing.T) {
		pid = qemuPID(t, dirs["b"], vmID)
		require.True(t, alive(pid), "the guest's QEMU %d runs", pid)
		type row struct{ name, host string }
		listed := func(r *replicaProc) (map[string]row, error) {
			ctx, done := context.WithTimeout(ctx, 10*time.Second)
			defer done()
			l, err := vmsAt(r).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
			if err != nil {
				return nil, err
			}
			out := map[string]row{}
			for _, v := range l.Msg.Vms {
				out[v.Id] = row{v.Name, v.HostId}
			}
			return out, nil
		}
		before, err := listed(rs[0])
		require.NoError(t, err)
		evs, err := vmsAt(rs[0]).ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: vmID}))
		require.NoError(t, err)
		eventsBefore := len(evs.Msg.Events)
		require.NotZero(t, eventsBefore)

		down := time.Now()
		require.NoError(t, pg.Restart())
		t.Logf("PostgreSQL restarted in %s", time.Since(down).Round(10*time.Millisecond))
		for _, r := range rs {
			waitUntil(t, time.Minute, r.name+" answers from the database again, with every VM", func() (bool, string) {
				got, err := listed(r)
				if err != nil {
					return false, err.Error()
				}
				return assert.ObjectsAreEqual(before, got), fmt.Sprintf("%v, want %v", got, before)
			})
		}
		evs, err = vmsAt(rs[1]).ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: vmID}))
		require.NoError(t, err)
		assert.GreaterOrEqual(t, len(evs.Msg.Events), eventsBefore, "the VM's events are kept")

		r, err := vmsAt(rs[1]).CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{
			Name: "guest-a", HostId: hostIDs["a"], ImageUrl: f.imageURL, ImageSha256: f.imageSum,
			Vcpus: 1, MemMb: 256, DiskGb: 1, PowerState: "stopped",
		}))
		require.NoError(t, err, "a create through replica 2 after the restart")
		vm2 = r.Msg.Vm.Id
		waitUntil(t, 2*time.Minute, "host-a (on another replica) makes the VM created through replica 2, and every watcher hears it stopped", func() (bool, string) {
			v, ok := f.vms.get(vm2)
			if !ok {
				return false, "not in the watched list"
			}
			if v.Lifecycle == "failed" {
				t.Fatalf("the VM failed: %s", v.LastError)
			}
			seen := w2.of(vm2)
			if len(seen) == 0 {
				return false, "replica 2's watcher heard nothing of it"
			}
			return v.Lifecycle == "stopped" && seen[len(seen)-1].Lifecycle == "stopped", vmWords(v)
		})
		_, err = os.Stat(filepath.Join(dirs["a"], "vms", vm2))
		assert.NoError(t, err, "host-a holds the VM's disk")

		for _, h := range []string{"a", "b"} {
			f.waitConnected(t, hostIDs[h], true, time.Minute, "host-"+h+" is connected after the restart")
		}
		f.waitReady(t, vmID, time.Minute, "the guest on host-b is ready after the restart")
		assert.Equal(t, pid, qemuPID(t, dirs["b"], vmID), "the guest's QEMU is the one from before the restart")
		assert.True(t, alive(pid), "QEMU %d still runs", pid)
	})

	mustRun(t, "the replicas restart one at a time: no guest stops, and the VMs stay as they were", func(t *testing.T) {
		heard := len(w2.of(vmID))
		for _, r := range rs {
			var held []string // the hosts whose agent is on r
			for _, h := range []string{"a", "b"} {
				if slices.Contains(agentPeers(t, base, h), r.addr) {
					held = append(held, h)
				}
			}
			offsets := map[*replicaProc]int64{}
			for _, q := range rs {
				offsets[q] = q.p.logSize()
			}
			r.p.stop(t)
			r.start(t, f)
			require.Equal(t, f.fp, waitServing(t, r.p, r.addr), "%s comes back with the fleet's certificate", r.name)
			// An agent whose replica went reconnects to whichever answers
			// first: another, or the restarted one if it is back by then.
			for _, h := range held {
				waitUntil(t, 30*time.Second, "agent-"+h+", whose stream was on "+r.name+", connects again", func() (bool, string) {
					for _, q := range rs {
						if hostConnectedRE(hostIDs[h]).MatchString(q.p.logSince(offsets[q])) {
							return true, ""
						}
					}
					return false, fmt.Sprintf("no replica says it connected; its connections: %q", agentPeers(t, base, h))
				})
				t.Logf("%s restarted; host-%s connected again, through %q", r.name, h, agentPeers(t, base, h))
			}
			// Every replica, the restarted one included, says so.
			for _, q := range rs {
				waitUntil(t, time.Minute, q.name+" says both hosts connected, the guest ready and the other VM stopped, after "+r.name+" restarted", func() (bool, string) {
					ctx, done := context.WithTimeout(ctx, 10*time.Second)
					defer done()
					for _, h := range []string{"a", "b"} {
						require.False(t, agents[h].exited(), "agent-%s runs", h)
						x, err := eitriv1connect.NewHostServiceClient(f.hc, q.url, f.auth).GetHost(ctx, connect.NewRequest(&eitriv1.GetHostRequest{Id: hostIDs[h]}))
						if err != nil {
							return false, err.Error()
						}
						if !x.Msg.Host.Connected || x.Msg.Host.Capacity == nil {
							return false, fmt.Sprintf("host-%s connected=%v capacity=%v", h, x.Msg.Host.Connected, x.Msg.Host.Capacity)
						}
					}
					for id, want := range map[string]string{vmID: "ready", vm2: "stopped"} {
						v, err := vmsAt(q).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
						if err != nil {
							return false, err.Error()
						}
						if v.Msg.Vm.Lifecycle != want {
							return false, id + ": " + vmWords(v.Msg.Vm)
						}
					}
					return true, ""
				})
			}
			assert.Equal(t, pid, qemuPID(t, dirs["b"], vmID), "the guest's QEMU is the same after %s restarted", r.name)
			require.True(t, alive(pid), "QEMU %d still runs after %s restarted", pid, r.name)
		}
		var lifecycles []string
		for _, v := range w2.of(vmID)[heard:] {
			lifecycles = append(lifecycles, v.Lifecycle)
		}
		t.Logf("replica 2's watcher (reopened when replica 2 restarted) heard the guest as %q meanwhile", lifecycles)
	})

	mustRun(t, "a stop through replica 3 stops the guest", func(t *testing.T) {
		_, err := vmsAt(rs[2]).StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: vmID}))
		require.NoError(t, err)
		waitUntil(t, 90*time.Second, "the guest on host-b stops", func() (bool, string) {
			v, ok := f.vms.get(vmID)
			if !ok {
				return false, "not in the watched list"
			}
			return v.Lifecycle == "stopped" && !alive(pid), fmt.Sprintf("%s qemu alive=%v", vmWords(v), alive(pid))
		})
	})
}

// agentPeers lists the replicas (host:port) the agent of host h has an
// established TCP connection to, as ss in its namespace says.
func agentPeers(t *testing.T, base, h string) []string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "exec", agentNS(base, h), "ss", "-Htn", "state", "established", "dst", cpIP).CombinedOutput()
	require.NoError(t, err, "ss: %s", out)
	var peers []string
	for _, line := range strings.Split(string(out), "\n") {
		fs := strings.Fields(line)
		if len(fs) == 0 {
			continue
		}
		peer := fs[len(fs)-1]
		if p, err := strconv.Atoi(peer[strings.LastIndexByte(peer, ':')+1:]); err == nil && p >= 7443 && p <= 7445 && !slices.Contains(peers, peer) {
			peers = append(peers, peer)
		}
	}
	slices.Sort(peers)
	return peers
}

func copyFile(from, to string) {
	in, err := os.Open(from)
	if err != nil {
		return
	}
	defer in.Close()
	out, err := os.Create(to)
	if err != nil {
		return
	}
	defer out.Close()
	_, _ = io.Copy(out, in)
}
