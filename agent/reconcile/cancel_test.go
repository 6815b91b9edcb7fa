package reconcile

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/imagecache"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// cancelBound is how long a cut-short create may take to let go: a
// correctness bound (it must happen), not a speed goal.
const cancelBound = 5 * time.Second

// wedge is a step that hangs until its pass gives up on it, as a trickled
// download or a guest that never takes its address does. Only the first
// time: later passes go straight through.
type wedge struct {
	armed   atomic.Bool
	entered chan struct{}
	left    chan error // why the wedged step's context ended
}

func newWedge() *wedge {
	w := &wedge{entered: make(chan struct{}, 1), left: make(chan error, 1)}
	w.armed.Store(true)
	return w
}

func (w *wedge) hang(ctx context.Context) error {
	if !w.armed.CompareAndSwap(true, false) {
		return nil
	}
	w.entered <- struct{}{}
	<-ctx.Done()
	w.left <- context.Cause(ctx)
	return ctx.Err()
}

// waitLeft waits for the wedged step to be let go and returns why it was.
func (w *wedge) waitLeft(t *testing.T) error {
	t.Helper()
	select {
	case why := <-w.left:
		return why
	case <-time.After(cancelBound):
		t.Fatal("the wedged step was not cancelled")
		return nil
	}
}

func deleted(d *eitriv1.VMDesired, at time.Time) *eitriv1.VMDesired {
	d.Deleted = true
	d.DestroyAtUnix = at.Unix()
	return d
}

// TestSteppingDownCutsAStuckCreateShort: deleting a VM, dropping it from the
// desired state or stopping it cancels its create wherever it is stuck; the
// create slot goes to the create queued behind it, the report stops
// narrating, and the VM settles the way the new state says.
func TestSteppingDownCutsAStuckCreateShort(t *testing.T) {
	type stuckIn int
	const (
		inDownload stuckIn = iota
		inBoot
	)
	type check func(t *testing.T, f *fixture, rep *eitriv1.ActualStateReport, where stuckIn)

	// Deleted or unnamed: nothing the create made is kept, but the record
	// is, so the VM leaves by its usual way.
	nothingHalfMade := func(t *testing.T, f *fixture) {
		assert.GreaterOrEqual(t, f.hv.count("destroy"), 1, "what the create made is removed")
		assert.False(t, f.hv.hasDisk("vm1"), "no half-made disk")
		assert.False(t, f.hv.isRunning("vm1"), "no half-booted guest")
		assert.Empty(t, f.record("vm1").BootID, "the record stays, unbuilt")
	}
	cases := []struct {
		name  string
		next  func(d *eitriv1.VMDesired, now time.Time) *eitriv1.VMDesired // nil: no longer named
		cause error
		check check
	}{
		{
			name:  "deleted",
			next:  func(d *eitriv1.VMDesired, now time.Time) *eitriv1.VMDesired { return deleted(d, now.Add(time.Hour)) },
			cause: errDeleted,
			check: func(t *testing.T, f *fixture, rep *eitriv1.ActualStateReport, _ stuckIn) {
				r := findVM(rep, "vm1")
				require.NotNil(t, r)
				assert.Equal(t, "deleting", r.GetPhase())
				assert.Equal(t, "stopped", r.GetPower())
				assert.Empty(t, r.GetLastError(), "a change of mind is not an error")
				assert.Empty(t, rep.GetDestroyed(), "soft delete: kept until destroy_at")
				nothingHalfMade(t, f)
			},
		},
		{
			name:  "no longer named",
			next:  nil,
			cause: errUnnamed,
			check: func(t *testing.T, f *fixture, rep *eitriv1.ActualStateReport, _ stuckIn) {
				assert.Nil(t, findVM(rep, "vm1"))
				assert.NotNil(t, findQuarantined(rep, "vm1"), "quarantined, as any unnamed VM")
				nothingHalfMade(t, f)
			},
		},
		{
			name:  "stopped",
			next:  func(d *eitriv1.VMDesired, _ time.Time) *eitriv1.VMDesired { return stopped(d) },
			cause: errStopped,
			check: func(t *testing.T, f *fixture, rep *eitriv1.ActualStateReport, where stuckIn) {
				r := findVM(rep, "vm1")
				require.NotNil(t, r)
				assert.Equal(t, "stopped", r.GetPhase())
				assert.Equal(t, "stopped", r.GetPower())
				assert.Empty(t, r.GetLastError())
				assert.False(t, f.hv.isRunning("vm1"), "a boot cut short leaves no guest running")
				assert.Zero(t, f.hv.count("destroy"), "a stopped VM keeps what it has")
				assert.Equal(t, where == inBoot, f.hv.hasDisk("vm1"), "a finished disk is kept for the start")
				assert.Empty(t, f.record("vm1").BootID, "not built until started")
			},
		},
	}
	for _, where := range []stuckIn{inDownload, inBoot} {
		for _, c := range cases {
			name := map[stuckIn]string{inDownload: "in its download", inBoot: "in its boot"}[where] + "/" + c.name
			t.Run(name, func(t *testing.T) {
				f := setup(t, func(cfg *Config) { cfg.MaxConcurrentCreates = 1 })
				w := newWedge()
				var mu sync.Mutex
				var straggler func(done, total int64)
				f.eng.cfg.Images = unpinned(func(ctx context.Context, _, sha string, progress func(done, total int64)) (string, error) {
					if sha == "slow" {
						mu.Lock()
						straggler = progress // kept, as a shared download keeps it
						mu.Unlock()
						progress(512<<20, 1<<30)
						if err := w.hang(ctx); err != nil {
							return "", err
						}
					}
					return "/cache/" + sha + ".raw", nil
				})
				stuck := vm("vm1")
				narrating := "downloading image 0.5/1.0 GiB"
				if where == inDownload {
					stuck.ImageSha256 = "slow"
				} else {
					narrating = "booting"
					f.hv.set(func(h *fakeHyper) {
						h.bootWait = func(ctx context.Context, id string) error {
							if id == "vm1" {
								return w.hang(ctx)
							}
							return nil
						}
					})
				}

				require.True(t, f.eng.Apply(snap(1, stuck)))
				<-w.entered
				f.eventuallyRow("vm1", detailIs(narrating), "precondition: the stuck create narrates")
				require.True(t, f.eng.Apply(snap(2, stuck, vm("vm2"))))
				f.eventuallyRow("vm2", detailIs(sayWaitingForSlot), "precondition: vm2 is queued behind it")

				var vms []*eitriv1.VMDesired
				if c.next != nil {
					vms = append(vms, c.next(vm("vm1"), f.clock.Now()))
					vms[0].ImageSha256 = stuck.ImageSha256
				}
				require.True(t, f.eng.Apply(snap(3, append(vms, vm("vm2"))...)))

				assert.Equal(t, c.cause, w.waitLeft(t), "cancelled by the new desired state, not a timeout")
				f.eventuallyRow("vm2", phaseIs("ready"), "the slot went to the queued create")
				f.waitIdle()

				if where == inDownload {
					mu.Lock()
					say := straggler
					mu.Unlock()
					say(1<<30, 1<<30) // the download drains on a goroutine the pass does not own
				}
				rep := f.eng.Report()
				if r := findVM(rep, "vm1"); r != nil {
					assert.Empty(t, r.GetStatusDetail(), "narration ended with its pass")
					assert.NotEqual(t, "creating", r.GetPhase())
				}
				c.check(t, f, rep, where)
				assert.Empty(t, f.eng.slots, "every slot was given back")
				assert.Zero(t, f.record("vm1").CreateAttempts, "no attempt spent")
			})
		}
	}
}

// A deleted VM whose create was cancelled takes the normal delete path:
// restorable until destroy_at (a restore builds it afresh), destroyed after.
func TestACancelledCreateOfADeletedVMIsRestoredAfreshOrDestroyedOnTime(t *testing.T) {
	for _, restore := range []bool{true, false} {
		t.Run(map[bool]string{true: "restored", false: "destroyed at destroy_at"}[restore], func(t *testing.T) {
			f := setup(t)
			w := newWedge()
			var fetches atomic.Int32
			f.eng.cfg.Images = unpinned(func(ctx context.Context, _, sha string, _ func(done, total int64)) (string, error) {
				fetches.Add(1)
				if err := w.hang(ctx); err != nil {
					return "", err
				}
				return "/cache/" + sha + ".raw", nil
			})
			require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
			<-w.entered
			destroyAt := f.clock.Now().Add(time.Hour)
			require.True(t, f.eng.Apply(snap(2, deleted(vm("vm1"), destroyAt))))
			require.Equal(t, errDeleted, w.waitLeft(t))
			f.waitIdle()
			key := f.record("vm1").HostPubKey

			if restore {
				rep := f.apply(snap(3, vm("vm1")))
				r := findVM(rep, "vm1")
				assert.Equal(t, "ready", r.GetPhase(), "a restore builds it")
				assert.Equal(t, int32(2), fetches.Load())
				assert.Equal(t, key, r.GetSshHostPubkey(), "the guest keeps the host key the control plane was told")
				return
			}
			f.clock.Advance(time.Hour)
			later := deleted(vm("vm1"), destroyAt)
			later.Vcpus = 2      // a change, so the worker runs a pass
			later.Destroy = true // the control plane's clock passed destroy_at
			rep := f.apply(snap(3, later))
			assert.Equal(t, []string{"vm1"}, rep.GetDestroyed())
			_, ok, err := f.st.LoadVM("vm1")
			require.NoError(t, err)
			assert.False(t, ok, "the record goes at destroy_at")
			assert.Equal(t, int32(1), fetches.Load(), "never fetched again")
		})
	}
}

// A stop cuts the create short; the VM then stays unbuilt, fetching nothing
// however often it is looked at, until it is started.
func TestAVMStoppedMidCreateIsBuiltWhenStarted(t *testing.T) {
	f := setup(t, func(c *Config) { c.ResyncInterval = 5 * time.Millisecond })
	w := newWedge()
	var fetches atomic.Int32
	f.eng.cfg.Images = unpinned(func(ctx context.Context, _, sha string, _ func(done, total int64)) (string, error) {
		fetches.Add(1)
		if err := w.hang(ctx); err != nil {
			return "", err
		}
		return "/cache/" + sha + ".raw", nil
	})
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	<-w.entered
	require.True(t, f.eng.Apply(snap(2, stopped(vm("vm1")))))
	require.Equal(t, errStopped, w.waitLeft(t))

	f.waitPasses("vm1", 3) // periodic re-checks
	assert.Equal(t, int32(1), fetches.Load(), "a stopped VM's create does not start over")
	r := f.row("vm1")
	assert.Equal(t, "stopped", r.GetPhase())
	assert.NotEmpty(t, r.GetSshHostPubkey())

	require.True(t, f.eng.Apply(snap(3, vm("vm1"))))
	f.eventuallyRow("vm1", phaseIs("ready"), "started, it is built and booted")
	assert.Equal(t, int32(2), fetches.Load())
}

// Only a step down cuts a pass short; anything that still wants what the
// pass is doing lets it finish, and the next pass does the rest.
func TestWhatCutsAPassShort(t *testing.T) {
	running := vm("vm1")
	with := func(f func(d *eitriv1.VMDesired)) *eitriv1.VMDesired {
		d := vm("vm1")
		f(d)
		return d
	}
	del := with(func(d *eitriv1.VMDesired) { d.Deleted = true })
	for _, c := range []struct {
		name       string
		old, newer *eitriv1.VMDesired
		want       error
	}{
		{"delete", running, del, errDeleted},
		{"dropped from the snapshot", running, nil, errUnnamed},
		{"stop", running, stopped(vm("vm1")), errStopped},
		{"stopped VM deleted", stopped(vm("vm1")), with(func(d *eitriv1.VMDesired) { d.Deleted, d.PowerState = true, "stopped" }), errDeleted},
		{"start", stopped(vm("vm1")), running, nil},
		{"restore", del, running, nil},
		{"new owner", running, with(func(d *eitriv1.VMDesired) { d.Owner = "bob" }), nil},
		{"more memory", running, with(func(d *eitriv1.VMDesired) { d.MemMb = 1024 }), nil},
		{"named again", nil, running, nil},
		{"delete of a deleted VM", del, nil, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.want, supersedes(c.old, c.newer))
		})
	}
}

// trickle serves an endless body one byte at a time (it declares 1 MiB and
// never gets there), counting what it sent and closing aborted when the
// client goes.
type trickle struct {
	*httptest.Server
	hits    atomic.Int32
	sent    atomic.Int64
	aborted chan struct{}
}

func newTrickle(t *testing.T, fast []byte) *trickle {
	s := &trickle{aborted: make(chan struct{})}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/fast" {
			w.Write(fast)
			return
		}
		s.hits.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(1<<20))
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			if _, err := w.Write([]byte{0}); err != nil {
				close(s.aborted)
				return
			}
			w.(http.Flusher).Flush()
			s.sent.Add(1)
			select {
			case <-r.Context().Done():
				close(s.aborted)
				return
			case <-tick.C:
			}
		}
	}))
	t.Cleanup(s.Close)
	return s
}

// With the real image cache and a real HTTP server: two VMs share one
// trickled download; deleting one frees its slot for a queued create and
// leaves the download running for the other; deleting the other ends the
// download and leaves nothing of it in the cache.
func TestDeletingVMsCancelsTheirSharedDownloadOnlyWhenNoneWantsIt(t *testing.T) {
	fast := []byte("a tiny raw image")
	srv := newTrickle(t, fast)
	cacheDir := t.TempDir()
	cache := imagecache.New(cacheDir, imagecache.WithDialPolicy(imagecache.AddressPolicy{
		Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")},
	}))
	f := setup(t, func(c *Config) {
		c.MaxConcurrentCreates = 2
		c.Images = unpinned(cache.Ensure)
	})
	slow := func(id string) *eitriv1.VMDesired {
		d := vm(id)
		d.ImageUrl, d.ImageSha256 = srv.URL+"/slow", strings.Repeat("5a", 32)
		return d
	}
	vm3 := vm("vm3")
	vm3.ImageUrl, vm3.ImageSha256 = srv.URL+"/fast", digestOf(fast)
	downloading := func(r *eitriv1.ActualVM) bool { return strings.HasPrefix(r.GetStatusDetail(), "downloading image") }

	require.True(t, f.eng.Apply(snap(1, slow("vm1"), slow("vm2"))))
	f.eventuallyRow("vm1", downloading, "precondition: vm1 is downloading")
	f.eventuallyRow("vm2", downloading, "precondition: vm2 is downloading")
	require.Eventually(t, func() bool { return srv.sent.Load() > 0 }, cancelBound, time.Millisecond)
	require.True(t, f.eng.Apply(snap(2, slow("vm1"), slow("vm2"), vm3)))
	f.eventuallyRow("vm3", detailIs(sayWaitingForSlot), "precondition: vm3 is queued")

	now := f.clock.Now()
	require.True(t, f.eng.Apply(snap(3, deleted(slow("vm1"), now.Add(time.Hour)), slow("vm2"), vm3)))
	f.eventuallyRow("vm1", func(r *eitriv1.ActualVM) bool { return r.GetPhase() == "deleting" && r.GetStatusDetail() == "" },
		"vm1's create ends at once")
	f.eventuallyRow("vm3", phaseIs("ready"), "vm1's slot went to vm3")
	sent := srv.sent.Load()
	require.Eventually(t, func() bool { return srv.sent.Load() > sent+10 }, cancelBound, time.Millisecond,
		"the download goes on for vm2")
	assert.Equal(t, int32(1), srv.hits.Load(), "one download, shared")
	assert.True(t, downloading(f.row("vm2")), "vm2 is still downloading: %v", f.row("vm2"))

	require.True(t, f.eng.Apply(snap(4, deleted(slow("vm1"), now.Add(time.Hour)), deleted(slow("vm2"), now.Add(time.Hour)), vm3)))
	select {
	case <-srv.aborted:
	case <-time.After(cancelBound):
		t.Fatal("the download went on with nobody wanting it")
	}
	f.eventuallyRow("vm2", func(r *eitriv1.ActualVM) bool { return r.GetPhase() == "deleting" && r.GetStatusDetail() == "" },
		"vm2's create ends")
	f.waitIdle()
	ents, err := os.ReadDir(cacheDir)
	require.NoError(t, err)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	assert.Equal(t, []string{digestOf(fast) + ".raw", digestOf(fast) + ".verified"}, names, "only vm3's image and its record; no partial download")
	assert.Empty(t, f.eng.slots)
}

func digestOf(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}
