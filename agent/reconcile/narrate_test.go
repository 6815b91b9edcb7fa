package reconcile

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// narrate runs one create directly with a collecting publisher and returns
// every row it published, in order.
func narrate(t *testing.T, f *fixture, ctx context.Context, d *eitriv1.VMDesired) ([]*eitriv1.ActualVM, outcome) {
	t.Helper()
	var rows []*eitriv1.ActualVM
	out := f.eng.create(ctx, d, state.Record{}, false, func(r *eitriv1.ActualVM) { rows = append(rows, r) })
	return rows, out
}

func details(rows []*eitriv1.ActualVM) []string {
	var s []string
	for _, r := range rows {
		s = append(s, r.GetStatusDetail())
	}
	return s
}

func TestCreateNarratesEachStepInOrder(t *testing.T) {
	f := setup(t)
	rows, out := narrate(t, f, context.Background(), vm("vm1"))

	assert.Equal(t, []string{
		"waiting for a create slot on this host",
		"downloading image",
		"preparing root disk",
		"building the cloud-init seed",
		"booting",
	}, details(rows))
	for _, r := range rows {
		assert.Equal(t, "creating", r.GetPhase(), "narration never changes the phase")
		assert.Equal(t, "stopped", r.GetPower())
		assert.Empty(t, r.GetLastError())
	}
	assert.Equal(t, "ready", out.row.GetPhase())
}

// A create's steps and the word each says are what a user watching a VM come
// up reads, and what the console and the tests of other packages match: a
// step moved, renamed or made silent shows here first.
func TestCreateStepsRunInOrderEachSayingItsWord(t *testing.T) {
	type step struct{ name, says string }
	var got []step
	for _, s := range createSteps {
		got = append(got, step{s.name, s.says})
	}
	assert.Equal(t, []step{
		{"host key", ""},
		{"preflight", ""},
		{"admission", ""},
		{"create slot", "waiting for a create slot on this host"},
		{"image", "downloading image"},
		{"root disk", "preparing root disk"},
		{"certify", "certifying the SSH host key"},
		{"seed", "building the cloud-init seed"},
		{"boot", "booting"},
	}, got)
}

// A create whose image the cache already holds downloads nothing, so its
// row says so; should the image go before the step runs, the download's
// own count follows at once.
func TestCreateOfACachedImageSaysItUsesIt(t *testing.T) {
	for _, tc := range []struct {
		name     string
		evicted  bool
		expected []string
	}{
		{"held", false, []string{"waiting for a create slot on this host", "using the cached image",
			"preparing root disk", "building the cloud-init seed", "booting"}},
		{"gone before the step ran", true, []string{"waiting for a create slot on this host", "using the cached image",
			"downloading image 1.0/4.0 MiB", "preparing root disk", "building the cloud-init seed", "booting"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var asked []string
			f := setup(t, func(c *Config) {
				c.ImageCached = func(sha string) bool { asked = append(asked, sha); return true }
				c.Images = unpinned(func(_ context.Context, _, sha string, progress func(done, total int64)) (string, error) {
					if tc.evicted {
						progress(1<<20, 4<<20)
					}
					return "/cache/" + sha + ".raw", nil
				})
			})
			d := vm("vm1")
			rows, out := narrate(t, f, context.Background(), d)
			assert.Equal(t, tc.expected, details(rows))
			assert.Equal(t, []string{d.GetImageSha256()}, asked, "asked once, of the VM's own image")
			assert.Equal(t, "ready", out.row.GetPhase())
		})
	}
}

// A record the store cannot keep is the store's fault: the attempt ends at
// the host key step, before anything is done or said for the VM, and spends
// none of its budget.
func TestACreateWhoseRecordCannotBeSavedStopsAtTheHostKey(t *testing.T) {
	dir := t.TempDir()
	st, err := state.Open(dir)
	require.NoError(t, err)
	f := setupOn(t, st, newFakeHyper())
	// The records' directory made a file: every save fails.
	require.NoError(t, os.RemoveAll(filepath.Join(dir, "vms")))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "vms"), nil, 0o600))

	rows, out := narrate(t, f, context.Background(), vm("vm1"))
	assert.Empty(t, rows, "nothing is said for a VM with no record")
	require.NotNil(t, out.row)
	assert.Equal(t, "creating", out.row.GetPhase())
	assert.Equal(t, "cannot save the VM record", out.row.GetStatusDetail())
	assert.NotEmpty(t, out.row.GetLastError())
	assert.NotEmpty(t, out.row.GetSshHostPubkey(), "every row of a create carries the host key")
	assert.True(t, out.wakeAt.IsZero(), "no backoff: no attempt was spent")
	assert.Equal(t, 0, f.hv.count("preflight"))
}

func TestCreatedStoppedVMDoesNotNarrateABoot(t *testing.T) {
	f := setup(t)
	rows, out := narrate(t, f, context.Background(), stopped(vm("vm1")))
	assert.NotContains(t, details(rows), "booting")
	assert.Equal(t, "stopped", out.row.GetPhase())
	assert.Equal(t, 0, f.hv.count("boot"))
	assert.NotEmpty(t, f.record("vm1").BootID, "disk and seed are complete, so the VM is created")
}

func TestCreateCountsOutTheDownload(t *testing.T) {
	f := setup(t)
	f.eng.cfg.Images = unpinned(func(_ context.Context, _, sha string, progress func(done, total int64)) (string, error) {
		progress(1_288_490_188, 3_972_844_748)
		progress(3_972_844_748, 3_972_844_748)
		return "/cache/" + sha + ".raw", nil
	})
	rows, _ := narrate(t, f, context.Background(), vm("vm1"))
	assert.Equal(t, []string{
		"waiting for a create slot on this host",
		"downloading image",
		"downloading image 1.2/3.7 GiB",
		"downloading image 3.7/3.7 GiB",
		"preparing root disk",
		"building the cloud-init seed",
		"booting",
	}, details(rows))
}

func TestDownloadDetailWords(t *testing.T) {
	for _, c := range []struct {
		name        string
		done, total int64
		want        string
	}{
		{"both in GiB", 1_288_490_188, 3_972_844_748, "downloading image 1.2/3.7 GiB"},
		{"unit follows the larger number", 429_496_730, 3_972_844_748, "downloading image 0.4/3.7 GiB"},
		{"below a GiB reads in MiB", 125_829_120, 536_870_912, "downloading image 120.0/512.0 MiB"},
		{"tiny still reads in MiB", 0, 1 << 10, "downloading image 0.0/0.0 MiB"},
		{"unknown total", 1_288_490_188, -1, "downloading image 1.2 GiB"},
		{"zero total is unknown", 5 << 20, 0, "downloading image 5.0 MiB"},
		{"exactly one GiB", 1 << 30, 1 << 30, "downloading image 1.0/1.0 GiB"},
	} {
		t.Run(c.name, func(t *testing.T) {
			assert.Equal(t, c.want, downloadDetail(c.done, c.total))
		})
	}
}

// The host key is level-triggered: every row, including mid-pass ones, must
// carry it or the control plane would stop vouching for the guest.
func TestNarrationCarriesTheGuestHostKey(t *testing.T) {
	f := setup(t)
	rows, out := narrate(t, f, context.Background(), vm("vm1"))
	key := f.record("vm1").HostPubKey
	require.NotEmpty(t, key)
	require.NotEmpty(t, rows)
	for _, r := range rows {
		assert.Equal(t, key, r.GetSshHostPubkey(), "row %q", r.GetStatusDetail())
	}
	assert.Equal(t, key, out.row.GetSshHostPubkey())
	assert.Equal(t, key, f.seeds.last().HostPubKey, "the guest gets the same key the report names")
	assert.Equal(t, f.record("vm1").HostPrivKey, f.seeds.last().HostPrivKey)
}

func TestCreateWithNobodyListeningStillCreates(t *testing.T) {
	f := setup(t)
	out := f.eng.create(context.Background(), vm("vm1"), state.Record{}, false, nil)
	require.NotNil(t, out.row)
	assert.Equal(t, "ready", out.row.GetPhase())
	assert.Equal(t, "running", out.row.GetPower())
	assert.Equal(t, "10.0.0.10", out.row.GetIp())
	assert.Empty(t, out.row.GetStatusDetail(), "a settled VM has nothing to add")
}

// A pass whose context is done stops narrating, so a download still draining
// on a goroutine the pass does not own never calls into it.
func TestADeadPassSaysNothing(t *testing.T) {
	f := setup(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	f.eng.cfg.Images = unpinned(func(_ context.Context, _, sha string, progress func(done, total int64)) (string, error) {
		cancel() // the watchdog fires mid-fetch
		progress(1_288_490_188, 3_972_844_748)
		return "/cache/" + sha + ".raw", nil
	})
	rows, _ := narrate(t, f, ctx, vm("vm1"))
	said := details(rows)
	assert.Contains(t, said, "downloading image", "precondition: the live pass did narrate")
	assert.NotContains(t, said, "downloading image 1.2/3.7 GiB")
	assert.NotContains(t, said, "preparing root disk")
}

// A progress line that arrives after its pass published a settled row must not
// put "creating" back on top of it; while the pass is live it must land.
func TestStragglerAfterPassEndIsDropped(t *testing.T) {
	f := setup(t, func(c *Config) { c.MaxCreateAttempts = 1 })

	var mu sync.Mutex
	var straggler func(done, total int64)
	narrated := make(chan struct{})
	release := make(chan struct{})
	f.eng.cfg.Images = unpinned(func(_ context.Context, _, _ string, progress func(done, total int64)) (string, error) {
		mu.Lock()
		straggler = progress // kept past the fetch, as a shared download keeps it
		mu.Unlock()
		progress(1_288_490_188, 3_972_844_748)
		close(narrated)
		<-release
		return "", errors.New("fetch gave up")
	})

	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	<-narrated
	row := f.row("vm1")
	require.NotNil(t, row, "a live pass narrates")
	assert.Equal(t, "downloading image 1.2/3.7 GiB", row.GetStatusDetail())

	close(release)
	f.waitIdle()
	require.Equal(t, "failed", f.row("vm1").GetPhase(), "precondition: the pass ended failed")

	mu.Lock()
	say := straggler
	mu.Unlock()
	say(3_972_844_748, 3_972_844_748)

	final := f.row("vm1")
	require.NotNil(t, final)
	assert.Equal(t, "failed", final.GetPhase(), "a straggler must not resurrect a finished create")
	assert.Equal(t, "fetch gave up", final.GetLastError())
	assert.Empty(t, final.GetStatusDetail())
}

// The generation check itself, apart from the dead-context guard: a publish
// stamped with an earlier pass never lands on a later pass in flight, and
// one after every pass has ended never lands at all.
func TestEarlierPassPublishIsDropped(t *testing.T) {
	f := setup(t)
	entered := make(chan struct{}, 4)
	release := make(chan struct{})
	f.eng.cfg.Images = unpinned(func(ctx context.Context, _, _ string, _ func(done, total int64)) (string, error) {
		entered <- struct{}{}
		<-release
		return "", errors.New("transient")
	})

	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	<-entered // pass 1 is wedged in the fetch
	w := f.worker("vm1")
	w.mu.Lock()
	firstGen := w.gen
	w.mu.Unlock()
	release <- struct{}{} // pass 1 fails (one attempt spent) and ends
	f.waitIdle()

	// Pass 2 (the retry) starts and wedges.
	d := vm("vm1")
	d.Vcpus = 2 // new desired state wakes the worker
	require.True(t, f.eng.Apply(snap(2, d)))
	<-entered
	f.eventuallyRow("vm1", detailIs("downloading image"), "pass 2 narrates")

	w.publish(firstGen, newRow("vm1", state.Record{}, "stopped", "creating", "", "from pass 1"))
	assert.Equal(t, "downloading image", f.row("vm1").GetStatusDetail(), "an earlier pass's row is dropped")

	w.mu.Lock()
	liveGen := w.gen
	w.mu.Unlock()
	require.Greater(t, liveGen, firstGen)
	w.publish(liveGen, newRow("vm1", state.Record{}, "stopped", "creating", "", "from pass 2"))
	assert.Equal(t, "from pass 2", f.row("vm1").GetStatusDetail(), "the live pass's row lands")

	close(release)
	f.waitIdle()
	settled := f.row("vm1")
	w.publish(liveGen, newRow("vm1", state.Record{}, "stopped", "creating", "", "after the end"))
	assert.Equal(t, settled, f.row("vm1"), "nothing lands once the pass has ended")
	assert.Equal(t, "transient", settled.GetLastError())
}
