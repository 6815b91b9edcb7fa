// Package reconcile is the host agent's engine: it turns complete desired
// snapshots from the control plane into virtual machines on this host, and
// describes what it sees as complete report rows.
//
// Every VM gets one worker goroutine that runs whole passes (create,
// converge, delete, quarantine) against the latest desired state it was
// handed. A pass runs without the worker's lock held, so building a report
// never waits on slow work; a create narrates itself mid-pass so the report
// can say which step a VM is in. Newer desired state that no longer wants what
// a pass is doing (the VM deleted, no longer named, or stopped) cuts it short:
// a create stuck in a download gives up its slot at once.
//
// Lifecycle: New builds an idle Engine; the first Apply starts workers (for
// every VM the snapshot names and every VM this host holds a record of);
// Close stops them and waits.
package reconcile

import (
	"context"
	"errors"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"google.golang.org/protobuf/proto"
)

// Hypervisor runs guests. The engine owns this interface; the QEMU backend
// implements it.
type Hypervisor interface {
	// Preflight says whether this host can run the VM at all. It runs before
	// any download or queueing, so a create that can only be refused costs
	// nothing.
	Preflight(ctx context.Context, spec state.VMSpec) error
	// PrepareRootDisk builds the VM's root disk from the cached base image.
	PrepareRootDisk(ctx context.Context, spec state.VMSpec, basePath string) error
	// Boot starts the guest process.
	Boot(ctx context.Context, spec state.VMSpec, seedPath string) error
	// Shutdown stops the guest cleanly, killing it after a grace period.
	Shutdown(ctx context.Context, id string) error
	// Power says whether the guest process is running.
	Power(ctx context.Context, id string) (running bool, err error)
	// Address is the guest's leased address, if one is known.
	Address(ctx context.Context, id string) (netip.Addr, bool)
	// SetOwner changes whose VM this is (state.VMSpec.Owner, which Boot
	// also carries) while it exists: the guest's network lets it reach
	// guests of the same owner only.
	SetOwner(ctx context.Context, id, owner string) error
	// Destroy removes everything the VM holds on this host: process, disk,
	// tap, lease.
	Destroy(ctx context.Context, id string) error
}

// Images resolves an image to a local raw base image, fetching it if needed.
// progress is called as a download advances (total <= 0 when the size is
// unknown); a cache hit may never call it.
type Images func(ctx context.Context, url, sha256 string, progress func(done, total int64)) (path string, err error)

// SeedParams is what the cloud-init seed carries.
type SeedParams struct {
	InstanceID, Hostname, SSHAuthorizedKey, HostPrivKey, HostPubKey string
}

// Seeder writes a cloud-init NoCloud seed image to outPath.
type Seeder func(outPath string, p SeedParams) error

// Config wires the engine to its building blocks. Hyper, Images, Seed and St
// are required; zero values elsewhere take the documented defaults.
type Config struct {
	Hyper  Hypervisor
	Images Images
	Seed   Seeder
	St     *state.Store

	// VMTimeout bounds one pass; 0 means passes are unbounded.
	VMTimeout time.Duration
	// MaxConcurrentCreates caps creates in flight on this host (default 2).
	MaxConcurrentCreates int
	// MaxCreateAttempts is the retry budget of a create (default 3).
	MaxCreateAttempts int
	// QuarantineGrace is how long a VM the desired state stopped naming is
	// kept before it is destroyed (default 24h).
	QuarantineGrace time.Duration
	// ResyncInterval is how often a worker re-runs a pass without being asked,
	// so power and address changes are noticed (default 5s).
	ResyncInterval time.Duration

	Log *slog.Logger
	Now func() time.Time
}

const (
	defaultMaxConcurrentCreates = 2
	defaultMaxCreateAttempts    = 3
	defaultQuarantineGrace      = 24 * time.Hour
	defaultResyncInterval       = 5 * time.Second
)

// Engine reconciles this host's VMs. Its methods are safe for concurrent use.
type Engine struct {
	cfg   Config
	log   *slog.Logger
	slots chan struct{} // create slots; a token held = one create in flight

	ctx    context.Context // cancelled by Close; parent of every pass
	cancel context.CancelFunc
	wg     sync.WaitGroup

	changed chan struct{}

	// mu guards the fields below. Lock order: Engine.mu before worker.mu,
	// never the other way.
	mu         sync.Mutex
	closed     bool
	started    bool // the first snapshot has been applied
	appliedGen uint64
	workers    map[string]*worker
	// destroyed holds VMs this host destroyed for good, reported until a
	// snapshot stops naming them. A snapshot that still names one never
	// gets it a worker again, so a destroyed VM cannot be recreated.
	destroyed map[string]struct{}
}

// New validates cfg and returns an idle engine. Workers start on the first
// Apply.
func New(cfg Config) (*Engine, error) {
	if cfg.Hyper == nil || cfg.Images == nil || cfg.Seed == nil || cfg.St == nil {
		return nil, errors.New("reconcile: Hyper, Images, Seed and St are required")
	}
	if cfg.VMTimeout < 0 {
		return nil, errors.New("reconcile: negative VMTimeout")
	}
	if cfg.MaxConcurrentCreates <= 0 {
		cfg.MaxConcurrentCreates = defaultMaxConcurrentCreates
	}
	if cfg.MaxCreateAttempts <= 0 {
		cfg.MaxCreateAttempts = defaultMaxCreateAttempts
	}
	if cfg.QuarantineGrace <= 0 {
		cfg.QuarantineGrace = defaultQuarantineGrace
	}
	if cfg.ResyncInterval <= 0 {
		cfg.ResyncInterval = defaultResyncInterval
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Engine{
		cfg:       cfg,
		log:       cfg.Log.With("component", "reconcile"),
		slots:     make(chan struct{}, cfg.MaxConcurrentCreates),
		ctx:       ctx,
		cancel:    cancel,
		changed:   make(chan struct{}, 1),
		workers:   make(map[string]*worker),
		destroyed: make(map[string]struct{}),
	}, nil
}

// Changed receives a value (coalesced) whenever the report may have changed.
func (e *Engine) Changed() <-chan struct{} { return e.changed }

func (e *Engine) notify() {
	select {
	case e.changed <- struct{}{}:
	default:
	}
}

// Apply hands a complete desired snapshot to the workers. It returns false,
// and changes nothing, when the snapshot is older than the newest applied or
// the engine is closed. Re-applying the newest generation is accepted (a
// reconnect resends it). The snapshot's messages must not be modified after
// the call.
func (e *Engine) Apply(snap *eitriv1.DesiredStateSnapshot) bool {
	if snap == nil {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed || (e.started && snap.GetGeneration() < e.appliedGen) {
		return false
	}
	genChanged := !e.started || snap.GetGeneration() != e.appliedGen
	e.appliedGen = snap.GetGeneration()

	named := make(map[string]*eitriv1.VMDesired, len(snap.GetVms()))
	for _, d := range snap.GetVms() {
		if !state.ValidID(d.GetVmId()) {
			e.log.Warn("ignoring desired VM with an unusable id", "vm", d.GetVmId())
			continue
		}
		named[d.GetVmId()] = d
	}

	if !e.started {
		e.started = true
		// VMs this host holds from before: a snapshot that does not name them
		// quarantines them, one that does adopts them.
		ids, err := e.cfg.St.ListVMs()
		if err != nil {
			e.log.Error("listing local VM records", "err", err)
		}
		for _, id := range ids {
			if _, ok := named[id]; !ok && state.ValidID(id) {
				e.workerLocked(id).setDesired(nil)
			}
		}
	}

	destroyedChanged := false
	for id := range e.destroyed {
		if _, ok := named[id]; !ok {
			delete(e.destroyed, id)
			destroyedChanged = true
		}
	}
	for id, d := range named {
		if _, gone := e.destroyed[id]; gone {
			continue
		}
		e.workerLocked(id).setDesired(d)
	}
	for id, w := range e.workers {
		if _, ok := named[id]; !ok {
			w.setDesired(nil)
		}
	}
	if genChanged || destroyedChanged {
		e.notify()
	}
	return true
}

// workerLocked returns the VM's worker, starting one if needed. e.mu held.
func (e *Engine) workerLocked(id string) *worker {
	if w, ok := e.workers[id]; ok {
		return w
	}
	w := newWorker(e, id)
	e.workers[id] = w
	e.wg.Add(1)
	go w.run()
	return w
}

// retire removes a worker whose VM no longer exists on this host. It refuses
// (returns false) when new desired state arrived after the pass that found
// the VM gone started, so a snapshot delivered in between is never lost.
func (e *Engine) retire(w *worker, seenSeq uint64, destroyed bool) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.seq != seenSeq && !destroyed {
		return false
	}
	if e.workers[w.id] == w {
		delete(e.workers, w.id)
	}
	if destroyed {
		e.destroyed[w.id] = struct{}{}
	}
	w.retired = true
	e.notify()
	return true
}

// Fill sets the engine's part of a host report: every VM row, the destroyed
// and quarantined VMs, and the applied generation. Rows are shared with the
// engine and must be treated as read-only.
func (e *Engine) Fill(rep *eitriv1.ActualStateReport) {
	e.mu.Lock()
	defer e.mu.Unlock()
	vms := make([]*eitriv1.ActualVM, 0, len(e.workers))
	var quar []*eitriv1.QuarantinedVM
	for _, w := range e.workers {
		w.mu.Lock()
		if w.row != nil {
			vms = append(vms, w.row)
		}
		if w.quar != nil {
			quar = append(quar, w.quar)
		}
		w.mu.Unlock()
	}
	slices.SortFunc(vms, func(a, b *eitriv1.ActualVM) int { return cmpString(a.GetVmId(), b.GetVmId()) })
	slices.SortFunc(quar, func(a, b *eitriv1.QuarantinedVM) int { return cmpString(a.GetVmId(), b.GetVmId()) })
	destroyed := make([]string, 0, len(e.destroyed))
	for id := range e.destroyed {
		destroyed = append(destroyed, id)
	}
	slices.Sort(destroyed)
	rep.Vms = vms
	rep.Quarantined = quar
	rep.Destroyed = destroyed
	rep.AppliedGeneration = e.appliedGen
}

// Report is Fill into a fresh report.
func (e *Engine) Report() *eitriv1.ActualStateReport {
	rep := &eitriv1.ActualStateReport{}
	e.Fill(rep)
	return rep
}

// Close stops every worker, cancelling passes in flight, and waits for them.
func (e *Engine) Close() {
	e.mu.Lock()
	e.closed = true
	e.mu.Unlock()
	e.cancel()
	e.wg.Wait()
}

func cmpString(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// rowsEqual decides whether a new row is worth a Changed notification.
func rowsEqual(a, b *eitriv1.ActualVM) bool {
	if a == nil || b == nil {
		return a == b
	}
	return proto.Equal(a, b)
}
