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
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
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
	// Address is the address the guest took in its current boot, if it
	// has: known (and reported) before the guest is ready.
	Address(ctx context.Context, id string) (netip.Addr, bool)
	// Ready says whether the guest is usable in its current boot, judged
	// as how says, and what said so (ActualVM.ready_signal: "cloud-init",
	// "ssh", "dhcp").
	Ready(ctx context.Context, id string, how state.Readiness) (signal string, ok bool)
	// SetOwner changes whose VM this is (state.VMSpec.Owner, which Boot
	// also carries) while it exists: the guest's network lets it reach
	// guests of the same owner only.
	SetOwner(ctx context.Context, id, owner string) error
	// Destroy removes everything the VM holds on this host: process, disk,
	// tap, lease.
	Destroy(ctx context.Context, id string) error
	// Exited reports, once, that the VM's guest process ended without
	// Shutdown or Destroy asking it to (a crash, a kill, a host reboot), and
	// how: so a restart is told from a start, and counted.
	Exited(ctx context.Context, id string) (GuestExit, bool)
}

// GuestExit is how a guest process ended when nobody asked it to.
type GuestExit struct {
	// Reason for people: "qemu exited (signal 9)".
	Reason string
	// SerialTail is the last lines of its serial console.
	SerialTail string
}

// Images resolves an image to a local raw base image, fetching it if needed.
// progress is called as a download advances (total <= 0 when the size is
// unknown); a cache hit may never call it. The image stays where path says
// (the cache may not evict it) until release is called; the engine calls it
// exactly once on every path after a successful resolve, once the root disk
// holds the image or the create has failed. On error there is nothing to
// release.
type Images func(ctx context.Context, url, sha256 string, progress func(done, total int64)) (path string, release func(), err error)

// SeedParams is what the cloud-init seed carries.
type SeedParams struct {
	InstanceID, Hostname, SSHAuthorizedKey, HostPrivKey, HostPubKey string
	// LoginUser is the user the seed creates with the key and sudo;
	// reported as the VM's login user.
	LoginUser string
	// TrustedUserCAKeys are the SSH user CA keys the guest's sshd trusts
	// (VMDesired.ssh_user_ca_keys); HostCertificate certifies HostPubKey
	// (empty: uncertified).
	TrustedUserCAKeys []string
	// UserCertPrincipal is the certificate principal the guest's sshd
	// accepts for LoginUser (wire/sshcert.Principal).
	UserCertPrincipal string
	HostCertificate   string
}

// HostKeySigner has the control plane certify a guest's host key
// (authorized_keys form), returning the certificate in the same form.
type HostKeySigner func(ctx context.Context, vmID, hostPubKey string) (cert string, err error)

// Seeder writes a cloud-init NoCloud seed image to outPath.
type Seeder func(outPath string, p SeedParams) error

// Config wires the engine to its building blocks. Hyper, Images, Seed and St
// are required; zero values elsewhere take the documented defaults.
type Config struct {
	Hyper  Hypervisor
	Images Images
	Seed   Seeder
	St     *state.Store

	// ImageCached says whether Images already holds an image (by digest),
	// so a create whose image is cached says so instead of "downloading
	// image". nil: every create's image step says it downloads.
	ImageCached func(sha256 string) bool

	// VMTimeout bounds one pass; 0 means passes are unbounded.
	VMTimeout time.Duration
	// MaxConcurrentCreates caps creates in flight on this host (default 2).
	MaxConcurrentCreates int
	// MaxCreateAttempts is the retry budget of a create (default 5).
	MaxCreateAttempts int
	// MaxRestarts is how many failed runs in a row (the guest ending
	// unasked, or a start that failed) are restarted before the VM is
	// failed (default 5). StableAfter is how long a guest must stay up for
	// its failed runs to be forgotten (default 10m).
	MaxRestarts int
	StableAfter time.Duration
	// RetryBackoff is the wait after the first failed create attempt (and
	// before the second restart in a row); each further failure doubles
	// it, up to MaxRetryBackoff (defaults 20s and 5m). Jitter picks the
	// wait actually used for a backoff of d (default: uniformly from
	// [d/2, d]), so VMs failed by one outage do not retry in step.
	RetryBackoff, MaxRetryBackoff time.Duration
	Jitter                        func(d time.Duration) time.Duration
	// ResyncInterval is how often a worker re-runs a pass without being asked,
	// so power and address changes are noticed (default 5s).
	ResyncInterval time.Duration
	// LoginUser is the user every new VM's seed creates with its key
	// (default DefaultLoginUser).
	LoginUser string
	// Capacity measures what this host can give guests (nil: no admission
	// check). A create that does not fit it, beside what the host's VMs
	// hold, fails before any work (see admit).
	Capacity func() (Resources, error)
	// SignHostKey certifies each new guest's host key before its seed is
	// written (nil: guests get no host certificate). A guest whose key
	// cannot be certified boots without a certificate.
	SignHostKey HostKeySigner
	// SignTimeout bounds one SignHostKey call (default 15s): a control
	// plane that does not answer delays a create by no more.
	SignTimeout time.Duration

	Log *slog.Logger
	Now func() time.Time
}

// DefaultLoginUser is the login user seeds create: one name on every image,
// where images' own default users differ.
const DefaultLoginUser = "eitri"

const (
	defaultMaxConcurrentCreates = 2
	defaultMaxCreateAttempts    = 5
	defaultMaxRestarts          = 5
	defaultStableAfter          = 10 * time.Minute
	defaultRetryBackoff         = 20 * time.Second
	defaultMaxRetryBackoff      = 5 * time.Minute
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

	// admitMu serialises admission checks; admitted holds the VMs whose
	// create passed one in this engine's life (see holding).
	admitMu  sync.Mutex
	admitted map[string]bool

	// certChecks says when each VM's host certificate is next due.
	certChecks hostCertChecks

	// mu guards the fields below. Lock order: Engine.mu before worker.mu,
	// never the other way.
	mu      sync.Mutex
	closed  bool
	started bool // the first snapshot has been applied
	// lineage is the control plane this host follows and the newest
	// snapshot applied (kept durably); refusal is why the last snapshot
	// offered was refused, nil once one is applied.
	lineage state.Lineage
	refusal *eitriv1.SnapshotRefusal
	workers map[string]*worker
	// named is the last applied snapshot's VMs.
	named map[string]*eitriv1.VMDesired
	// pulls are the images the last snapshot wants held, by sha256.
	pulls map[string]*pull
	// destroyed holds every VM this host destroyed for good, and when (kept
	// durably). A snapshot that names one never gets it a worker again, so
	// a destroyed VM is never built anew under its id: named deleted, it is
	// reported destroyed; named live, it is a failed row that says so.
	destroyed map[string]time.Time
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
	if cfg.SignTimeout <= 0 {
		cfg.SignTimeout = 15 * time.Second
	}
	if cfg.MaxConcurrentCreates <= 0 {
		cfg.MaxConcurrentCreates = defaultMaxConcurrentCreates
	}
	if cfg.MaxCreateAttempts <= 0 {
		cfg.MaxCreateAttempts = defaultMaxCreateAttempts
	}
	if cfg.MaxRestarts <= 0 {
		cfg.MaxRestarts = defaultMaxRestarts
	}
	if cfg.StableAfter <= 0 {
		cfg.StableAfter = defaultStableAfter
	}
	if cfg.RetryBackoff <= 0 {
		cfg.RetryBackoff = defaultRetryBackoff
	}
	if cfg.MaxRetryBackoff <= 0 {
		cfg.MaxRetryBackoff = max(defaultMaxRetryBackoff, cfg.RetryBackoff)
	}
	cfg.MaxRetryBackoff = max(cfg.MaxRetryBackoff, cfg.RetryBackoff)
	if cfg.Jitter == nil {
		cfg.Jitter = equalJitter
	}
	if cfg.LoginUser == "" {
		cfg.LoginUser = DefaultLoginUser
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
	// What the agent trusts and what it destroyed must be known before the
	// first snapshot is judged; an unreadable record of either stops the
	// agent rather than trusting anyone or building a destroyed VM anew.
	lineage, _, err := cfg.St.LoadLineage()
	if err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	destroyed, err := cfg.St.Destroyed()
	if err != nil {
		return nil, fmt.Errorf("reconcile: %w", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Engine{
		cfg:       cfg,
		log:       cfg.Log.With("component", "reconcile"),
		slots:     make(chan struct{}, cfg.MaxConcurrentCreates),
		ctx:       ctx,
		cancel:    cancel,
		changed:   make(chan struct{}, 1),
		admitted:  make(map[string]bool),
		lineage:   lineage,
		workers:   make(map[string]*worker),
		named:     make(map[string]*eitriv1.VMDesired),
		destroyed: destroyed,
	}, nil
}

// Lineage is the control plane this host follows and the newest snapshot it
// applied, for Hello: a control plane behind it learns it lost writes.
func (e *Engine) Lineage() (controlPlaneID string, epoch, generation uint64) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.lineage.ControlPlaneID, e.lineage.Epoch, e.lineage.Generation
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
// and changes nothing on the host, when the engine is closed or the snapshot
// cannot be trusted (see distrust); the refusal is then reported until a
// snapshot is applied. Re-applying the newest generation is accepted (a
// reconnect resends it). The snapshot's messages must not be modified after
// the call.
func (e *Engine) Apply(snap *eitriv1.DesiredStateSnapshot) bool {
	if snap == nil {
		return false
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return false
	}
	if why := e.distrust(snap); why != "" {
		r := &eitriv1.SnapshotRefusal{ControlPlaneId: snap.GetControlPlaneId(), Epoch: snap.GetEpoch(), Generation: snap.GetGeneration(), Reason: why}
		if !proto.Equal(e.refusal, r) {
			e.log.Error("refusing the control plane's snapshot; nothing on this host changes", "why", why)
			e.refusal = r
			e.notify()
		}
		return false
	}
	next := state.Lineage{ControlPlaneID: cmp.Or(snap.GetControlPlaneId(), e.lineage.ControlPlaneID), Epoch: snap.GetEpoch(), Generation: snap.GetGeneration()}
	genChanged := !e.started || next != e.lineage || e.refusal != nil
	if next != e.lineage {
		// Durable before anything is acted on: after a restart the agent
		// still knows what it applied, and refuses anything older.
		if err := e.cfg.St.SaveLineage(next); err != nil {
			e.log.Error("saving the applied lineage", "err", err)
		}
		if next.Epoch > e.lineage.Epoch && e.lineage.Epoch > 0 {
			e.log.Warn("the control plane started a new epoch (it lost writes); VMs its records no longer match are held as they are",
				"epoch", next.Epoch, "was", e.lineage.Epoch)
		}
		e.lineage = next
	}
	e.refusal = nil

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
		// has them held, one that does adopts them. One marked destroyed
		// whose record outlived it (a crash mid-destroy) gets a worker that
		// finishes the destroy.
		ids, err := e.cfg.St.ListVMs()
		if err != nil {
			e.log.Error("listing local VM records", "err", err)
		}
		for _, id := range ids {
			_, gone := e.destroyed[id]
			if _, ok := named[id]; (!ok || gone) && state.ValidID(id) {
				e.workerLocked(id).setDesired(nil)
			}
		}
	}

	e.named = named
	e.applyPullsLocked(snap.GetImages())
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
	if genChanged {
		e.notify()
	}
	return true
}

// distrust says why a snapshot must not be applied, or "" when it may. The
// agent takes desired state only from the control plane it first followed,
// and never from one that went back in time: a snapshot older than the
// newest applied (an earlier epoch, or an earlier generation in the same
// epoch) comes from a control plane that lost writes and does not know it
// yet. Acting on it could stop or destroy what its lost writes created.
func (e *Engine) distrust(snap *eitriv1.DesiredStateSnapshot) string {
	l := e.lineage
	cp := snap.GetControlPlaneId()
	switch {
	case l.ControlPlaneID != "" && cp == "":
		return fmt.Sprintf("the snapshot names no control plane (an older control plane?); this host follows control plane %s", l.ControlPlaneID)
	case l.ControlPlaneID != "" && cp != l.ControlPlaneID:
		return fmt.Sprintf("the snapshot comes from control plane %s, but this host follows control plane %s; "+
			"if that control plane was rebuilt from nothing, re-enroll this host", cp, l.ControlPlaneID)
	case snap.GetEpoch() < l.Epoch,
		snap.GetEpoch() == l.Epoch && snap.GetGeneration() < l.Generation:
		return fmt.Sprintf("the snapshot (epoch %d, generation %d) is older than the newest this host applied (epoch %d, generation %d): "+
			"the control plane went back in time (restored from an older copy, or lost its last writes)",
			snap.GetEpoch(), snap.GetGeneration(), l.Epoch, l.Generation)
	}
	return ""
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
	w.retiring = false // decided, whichever way
	if w.seq != seenSeq && !destroyed {
		return false
	}
	if e.workers[w.id] == w {
		delete(e.workers, w.id)
		e.certChecks.forget(w.id)
	}
	if destroyed {
		if _, ok := e.destroyed[w.id]; !ok {
			e.destroyed[w.id] = e.cfg.Now().UTC()
		}
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
	// Destroyed VMs the desired state still names: gone as asked, or, named
	// live (a restore that raced the destroy), a failed row that says so.
	destroyed := []string{}
	for id, d := range e.named {
		at, gone := e.destroyed[id]
		if !gone || e.workers[id] != nil {
			continue
		}
		if d.GetDeleted() {
			destroyed = append(destroyed, id)
			continue
		}
		vms = append(vms, &eitriv1.ActualVM{VmId: id, Power: vmstate.PowerStopped, Phase: vmstate.PhaseFailed, LastError: destroyedWords(at), Retry: d.GetRetry()})
	}
	slices.Sort(destroyed)
	slices.SortFunc(vms, func(a, b *eitriv1.ActualVM) int { return cmpString(a.GetVmId(), b.GetVmId()) })
	rep.Vms = vms
	rep.Quarantined = quar
	rep.Destroyed = destroyed
	rep.AppliedGeneration = e.lineage.Generation
	rep.AppliedEpoch = e.lineage.Epoch
	rep.ControlPlaneId = e.lineage.ControlPlaneID
	rep.SnapshotRefused = e.refusal
	rep.Images = e.pullRowsLocked()
}

// destroyedWords is the error a destroyed VM named live reports.
func destroyedWords(at time.Time) string {
	when := "earlier"
	if !at.IsZero() {
		when = "at " + at.UTC().Format("2006-01-02 15:04:05 MST")
	}
	return "destroyed " + when + " on this host, with its disk; it is not built again under the same id"
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
