package reconcile

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// fakeHyper stands in for QEMU: it keeps guests as flags and addresses in
// memory and counts what it was asked to do.
type fakeHyper struct {
	mu           sync.Mutex
	judgedAs     map[string]state.Readiness // how Ready was last asked to judge each guest
	running      map[string]bool
	exits        map[string]GuestExit // guests that ended unasked, until Exited
	addr         map[string]netip.Addr
	disks        map[string]bool
	owners       map[string]string // as booted, then as set
	setOwnerErr  error
	calls        map[string]int // "boot", "prepare", ... across all VMs
	preflightErr error
	bootErr      error
	powerErr     error
	noAddress    bool // guests never lease (until withAddress)
	notReady     bool // leased guests are not ready yet
	nextHost     byte
	// bootWait, when set, runs after a guest has started, as a real boot
	// waits for the guest to take its address; an error it returns leaves
	// the guest running, as a real boot cut short does.
	bootWait func(ctx context.Context, id string) error
	// shutdownWait, when set, runs before a guest stops, as a real
	// shutdown waits for the guest to power off.
	shutdownWait func(ctx context.Context, id string) error
}

func newFakeHyper() *fakeHyper {
	return &fakeHyper{
		running: map[string]bool{}, exits: map[string]GuestExit{}, addr: map[string]netip.Addr{},
		disks: map[string]bool{}, owners: map[string]string{}, calls: map[string]int{}, nextHost: 10,
	}
}

func (h *fakeHyper) count(op string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls[op]
}

func (h *fakeHyper) isRunning(id string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.running[id]
}

func (h *fakeHyper) hasDisk(id string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.disks[id]
}

// crash stops a guest behind the engine's back.
func (h *fakeHyper) crash(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.running[id] = false
}

func (h *fakeHyper) set(f func(h *fakeHyper)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	f(h)
}

func (h *fakeHyper) Preflight(_ context.Context, _ state.VMSpec) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls["preflight"]++
	return h.preflightErr
}

func (h *fakeHyper) PrepareRootDisk(_ context.Context, spec state.VMSpec, basePath string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls["prepare"]++
	if basePath == "" {
		return errors.New("no base image")
	}
	h.disks[spec.ID] = true
	return nil
}

func (h *fakeHyper) Boot(ctx context.Context, spec state.VMSpec, seedPath string) error {
	h.mu.Lock()
	h.calls["boot"]++
	if h.bootErr != nil {
		h.mu.Unlock()
		return h.bootErr
	}
	if !h.disks[spec.ID] || !strings.HasSuffix(seedPath, "seed.iso") {
		h.mu.Unlock()
		return errors.New("boot without disk or seed")
	}
	h.running[spec.ID] = true
	h.owners[spec.ID] = spec.Owner
	if _, ok := h.addr[spec.ID]; !ok {
		h.addr[spec.ID] = netip.AddrFrom4([4]byte{10, 0, 0, h.nextHost})
		h.nextHost++
	}
	wait := h.bootWait
	h.mu.Unlock()
	if wait != nil {
		return wait(ctx, spec.ID)
	}
	return nil
}

func (h *fakeHyper) Shutdown(ctx context.Context, id string) error {
	h.mu.Lock()
	h.calls["shutdown"]++
	wait := h.shutdownWait
	h.mu.Unlock()
	if wait != nil {
		if err := wait(ctx, id); err != nil {
			return err
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.running[id] = false
	return nil
}

func (h *fakeHyper) Power(_ context.Context, id string) (bool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.powerErr != nil {
		return false, h.powerErr
	}
	return h.running[id], nil
}

func (h *fakeHyper) Address(_ context.Context, id string) (netip.Addr, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	a, ok := h.addr[id]
	if h.noAddress || !ok || !h.running[id] {
		return netip.Addr{}, false
	}
	return a, true
}

// Ready: a fake guest is usable once it has its address, unless notReady.
func (h *fakeHyper) Ready(ctx context.Context, id string, how state.Readiness) (string, bool) {
	if _, ok := h.Address(ctx, id); !ok {
		return "", false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.judgedAs == nil {
		h.judgedAs = map[string]state.Readiness{}
	}
	h.judgedAs[id] = how
	if h.notReady {
		return "", false
	}
	return "fake", true
}

func (h *fakeHyper) SetOwner(_ context.Context, id, owner string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls["setowner"]++
	if h.setOwnerErr != nil {
		return h.setOwnerErr
	}
	h.owners[id] = owner
	return nil
}

func (h *fakeHyper) ownerOf(id string) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.owners[id]
}

func (h *fakeHyper) Destroy(_ context.Context, id string) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls["destroy"]++
	delete(h.running, id)
	delete(h.disks, id)
	delete(h.addr, id)
	return nil
}

// Exited reports, once, a guest that crashed behind the engine's back
// (crash, exit).
func (h *fakeHyper) Exited(_ context.Context, id string) (GuestExit, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	x, ok := h.exits[id]
	delete(h.exits, id)
	return x, ok
}

// exit ends a guest behind the engine's back the way a QEMU that died
// does: it is not running, and Exited says how it ended.
func (h *fakeHyper) exit(id string, x GuestExit) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.running[id] = false
	h.exits[id] = x
}

// fakeClock is a settable Now.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

type fixture struct {
	t     testing.TB
	eng   *Engine
	hv    *fakeHyper
	st    *state.Store
	clock *fakeClock
	seeds *seedLog
}

// seedLog records every seed the engine asked for.
type seedLog struct {
	mu     sync.Mutex
	params []SeedParams
}

func (s *seedLog) last() SeedParams {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.params[len(s.params)-1]
}

// unpinned is an Images over resolve that pins nothing, so has nothing to
// release.
func unpinned(resolve func(ctx context.Context, url, sha256 string, progress func(done, total int64)) (string, error)) Images {
	return func(ctx context.Context, url, sha256 string, progress func(done, total int64)) (string, func(), error) {
		path, err := resolve(ctx, url, sha256, progress)
		if err != nil {
			return "", nil, err
		}
		return path, func() {}, nil
	}
}

// setup builds an engine over a fake hypervisor and a real store in a temp
// dir. The resync interval is long so passes run only when a test asks;
// tests that exercise the periodic re-check shorten it.
func setup(t testing.TB, opts ...func(*Config)) *fixture {
	t.Helper()
	st, err := state.Open(t.TempDir())
	require.NoError(t, err)
	return setupOn(t, st, newFakeHyper(), opts...)
}

func setupOn(t testing.TB, st *state.Store, hv *fakeHyper, opts ...func(*Config)) *fixture {
	t.Helper()
	clock := &fakeClock{now: time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)}
	seeds := &seedLog{}
	cfg := Config{
		Hyper: hv,
		Images: unpinned(func(_ context.Context, _, sha string, _ func(done, total int64)) (string, error) {
			return "/cache/" + sha + ".raw", nil
		}),
		Seed: func(out string, p SeedParams) error {
			seeds.mu.Lock()
			defer seeds.mu.Unlock()
			seeds.params = append(seeds.params, p)
			return nil
		},
		St:             st,
		ResyncInterval: time.Hour,
		// No backoff unless a test asks for one: the fake clock stands
		// still, and most tests are about what a retry does, not when.
		Jitter: func(time.Duration) time.Duration { return 0 },
		Log:    slog.New(slog.NewTextHandler(io.Discard, nil)),
		Now:    clock.Now,
	}
	for _, o := range opts {
		o(&cfg)
	}
	eng, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(eng.Close)
	return &fixture{t: t, eng: eng, hv: hv, st: st, clock: clock, seeds: seeds}
}

func vm(id string) *eitriv1.VMDesired {
	return &eitriv1.VMDesired{
		VmId:             id,
		Name:             "name-" + id,
		ImageUrl:         "http://images.test/base.raw",
		ImageSha256:      strings.Repeat("ab", 32),
		Vcpus:            1,
		MemMb:            256,
		DiskGb:           1,
		PowerState:       "running",
		SshAuthorizedKey: "ssh-ed25519 AAAA user@test",
	}
}

func stopped(d *eitriv1.VMDesired) *eitriv1.VMDesired {
	d.PowerState = "stopped"
	return d
}

func snap(gen uint64, vms ...*eitriv1.VMDesired) *eitriv1.DesiredStateSnapshot {
	return &eitriv1.DesiredStateSnapshot{Generation: gen, Vms: vms}
}

func findVM(rep *eitriv1.ActualStateReport, id string) *eitriv1.ActualVM {
	for _, v := range rep.GetVms() {
		if v.GetVmId() == id {
			return v
		}
	}
	return nil
}

func findQuarantined(rep *eitriv1.ActualStateReport, id string) *eitriv1.QuarantinedVM {
	for _, q := range rep.GetQuarantined() {
		if q.GetVmId() == id {
			return q
		}
	}
	return nil
}

// row is the VM's current report row (nil if none).
func (f *fixture) row(id string) *eitriv1.ActualVM { return findVM(f.eng.Report(), id) }

// apply applies a snapshot and waits until every worker has finished the
// passes it caused.
func (f *fixture) apply(s *eitriv1.DesiredStateSnapshot) *eitriv1.ActualStateReport {
	f.t.Helper()
	require.True(f.t, f.eng.Apply(s))
	f.waitIdle()
	return f.eng.Report()
}

// waitIdle polls until no worker has a pass running or queued.
func (f *fixture) waitIdle() {
	f.t.Helper()
	require.Eventually(f.t, func() bool {
		f.eng.mu.Lock()
		defer f.eng.mu.Unlock()
		for _, w := range f.eng.workers {
			if !w.idle() {
				return false
			}
		}
		return true
	}, 5*time.Second, time.Millisecond)
}

// eventuallyRow polls until the VM's row satisfies cond and returns it.
func (f *fixture) eventuallyRow(id string, cond func(*eitriv1.ActualVM) bool, msg string) *eitriv1.ActualVM {
	f.t.Helper()
	var got *eitriv1.ActualVM
	require.Eventually(f.t, func() bool {
		got = f.row(id)
		return got != nil && cond(got)
	}, 5*time.Second, time.Millisecond, msg)
	return got
}

func (f *fixture) record(id string) state.Record {
	f.t.Helper()
	rec, ok, err := f.st.LoadVM(id)
	require.NoError(f.t, err)
	require.True(f.t, ok, "record for %s", id)
	return rec
}

func (f *fixture) worker(id string) *worker {
	f.eng.mu.Lock()
	defer f.eng.mu.Unlock()
	return f.eng.workers[id]
}

// passesRun is how many passes the VM's worker has started.
func (f *fixture) passesRun(id string) uint64 {
	w := f.worker(id)
	require.NotNil(f.t, w)
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.passes
}

// waitPasses waits until the VM's worker has started n more passes.
func (f *fixture) waitPasses(id string, n uint64) {
	f.t.Helper()
	start := f.passesRun(id)
	require.Eventually(f.t, func() bool { return f.passesRun(id) >= start+n }, 5*time.Second, time.Millisecond)
	f.waitIdle()
}

func phaseIs(p string) func(*eitriv1.ActualVM) bool {
	return func(r *eitriv1.ActualVM) bool { return r.GetPhase() == p }
}

func detailIs(d string) func(*eitriv1.ActualVM) bool {
	return func(r *eitriv1.ActualVM) bool { return r.GetStatusDetail() == d }
}

// permErr is an error a building block marks as not worth retrying.
type permErr struct{ msg string }

func (e permErr) Error() string   { return e.msg }
func (e permErr) Permanent() bool { return true }
