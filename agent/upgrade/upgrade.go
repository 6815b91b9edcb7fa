// Package upgrade is the agent replacing itself with a newer build while its
// guests keep running: it fetches the build the control plane offers
// (resuming a cut-off download), checks it against the release key the host
// learned at enrollment — never against anything the control plane says —
// runs it once to hear it say the expected version, swaps it in atomically
// keeping the previous build, and hands the process over by re-exec. A guard
// (the previous build, started beside it) watches the new agent: one that
// exits, or does not reconnect and report within a bound, is swapped back
// and restarted as the previous build by the host itself, and the failure
// is reported. Guests are separate processes (QEMU, daemonized) and never
// stop; the new agent adopts them as any restarted agent does.
package upgrade

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/release"
)

// Steps, as AgentUpgradeStatus.step says them.
const (
	StepDownloading = "downloading"
	StepVerifying   = "verifying"
	StepTesting     = "testing"
	StepRestarting  = "restarting"
	StepDone        = "done"
	StepFailed      = "failed"
)

// fetchAttempts is how many times a download is resumed before the offer
// fails.
const fetchAttempts = 5

// DefaultHealthBound is how long a new agent has to reconnect and report
// before its host rolls it back.
const DefaultHealthBound = 60 * time.Second

// Config wires an Upgrader.
type Config struct {
	// Dir holds downloads, the previous build and the upgrade's records; it
	// lives in the agent's data dir.
	Dir string
	// Exe is the running binary, the one an upgrade replaces.
	Exe string
	// Version is this build's.
	Version string
	// Key is the release key builds must be signed with; zero refuses
	// every offer.
	Key release.PublicKey
	// Client fetches builds (pinned to the control plane); BaseURL is the
	// control plane's URL the offer's path is on; Credential the host's.
	// With several replicas, Client is the agent's failover client
	// (wire/connclient.Replicas) and BaseURL the URL its requests name: a
	// download lands on whichever replica answers, and one cut off resumes
	// on the next, as every replica serves the same bytes.
	Client     *http.Client
	BaseURL    func() string
	Credential string
	// HealthBound: see DefaultHealthBound.
	HealthBound time.Duration
	// ProbeTimeout bounds running the new build to ask its version
	// (default 30s).
	ProbeTimeout time.Duration
	// RetryWait is the wait before resuming a cut-off download, doubling
	// after each (default 2s).
	RetryWait time.Duration
	Log       *slog.Logger
}

// Restart is the error Run ends with once a new build is in place: the
// agent stops and calls Exec with it.
type Restart struct {
	Exe     string
	Version string
}

func (r *Restart) Error() string { return "restarting into agent " + r.Version }

// Upgrader is safe for concurrent use.
type Upgrader struct {
	cfg Config
	log *slog.Logger

	offers chan struct{}

	mu      sync.Mutex
	status  *eitriv1.AgentUpgradeStatus
	want    *eitriv1.AgentUpgrade
	refused map[string]bool // offers that failed here: not taken again
	trial   *trial          // set while this process is an unproved new build
}

// New reads what an earlier process left: the outcome of the last upgrade,
// and whether this process is a new build on trial.
func New(cfg Config) (*Upgrader, error) {
	if cfg.HealthBound == 0 {
		cfg.HealthBound = DefaultHealthBound
	}
	if cfg.ProbeTimeout == 0 {
		cfg.ProbeTimeout = 30 * time.Second
	}
	if cfg.RetryWait == 0 {
		cfg.RetryWait = 2 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, err
	}
	u := &Upgrader{cfg: cfg, log: cfg.Log, offers: make(chan struct{}, 1), refused: map[string]bool{}}
	var out outcome
	if ok, err := readJSON(filepath.Join(cfg.Dir, outcomeFile), &out); err != nil {
		return nil, err
	} else if ok {
		u.status = out.status()
		if out.Step == StepFailed {
			u.refused[key(out.RolloutID, out.Attempt, out.SHA256)] = true
		}
	}
	var t trial
	ok, err := readJSON(filepath.Join(cfg.Dir, trialFile), &t)
	switch {
	case err != nil:
		return nil, err
	case !ok:
	case t.Committed:
		_ = os.Remove(filepath.Join(cfg.Dir, trialFile))
	case t.Target == cfg.Version:
		u.trial = &t
		u.status = t.status(StepRestarting, "restarted as "+t.Target+", reconnecting", "")
	default:
		// The new build never proved itself and its guard is gone (the
		// host rebooted, or a service manager restarted the previous build
		// first): this process is the way back, so say it.
		out := outcome{Target: t.Target, Step: StepFailed, RolloutID: t.RolloutID, Attempt: t.Attempt, SHA256: t.SHA256, At: time.Now(),
			Error: fmt.Sprintf("agent %s stopped before it reconnected; back on %s", t.Target, cfg.Version)}
		out.Detail = out.Error
		if err := writeJSON(filepath.Join(cfg.Dir, outcomeFile), out); err != nil {
			return nil, err
		}
		_ = os.Remove(filepath.Join(cfg.Dir, trialFile))
		u.status = out.status()
		u.refused[key(out.RolloutID, out.Attempt, out.SHA256)] = true
	}
	return u, nil
}

func key(rollout string, attempt uint64, sha string) string {
	return fmt.Sprintf("%s/%d/%s", rollout, attempt, sha)
}

func (o outcome) status() *eitriv1.AgentUpgradeStatus {
	return &eitriv1.AgentUpgradeStatus{TargetVersion: o.Target, Step: o.Step, Detail: o.Detail, Error: o.Error,
		SinceUnix: o.At.Unix(), RolloutId: o.RolloutID, Attempt: o.Attempt}
}

func (t trial) status(step, detail, errMsg string) *eitriv1.AgentUpgradeStatus {
	return &eitriv1.AgentUpgradeStatus{TargetVersion: t.Target, Step: step, Detail: detail, Error: errMsg,
		SinceUnix: time.Now().Unix(), RolloutId: t.RolloutID, Attempt: t.Attempt}
}

// Status is the report's upgrade: what this host is doing about its offer,
// or how the last one ended; nil when it never had one.
func (u *Upgrader) Status() *eitriv1.AgentUpgradeStatus {
	u.mu.Lock()
	defer u.mu.Unlock()
	if u.status == nil {
		return nil
	}
	return &eitriv1.AgentUpgradeStatus{TargetVersion: u.status.GetTargetVersion(), Step: u.status.GetStep(), Detail: u.status.GetDetail(),
		Progress: u.status.GetProgress(), Error: u.status.GetError(), SinceUnix: u.status.GetSinceUnix(),
		RolloutId: u.status.GetRolloutId(), Attempt: u.status.GetAttempt()}
}

// Offer takes the latest snapshot's offer (nil: none). It never blocks.
func (u *Upgrader) Offer(o *eitriv1.AgentUpgrade) {
	u.mu.Lock()
	u.want = o
	u.mu.Unlock()
	select {
	case u.offers <- struct{}{}:
	default:
	}
}

// Healthy is told each time the agent has reconnected and applied a
// snapshot. A new build on trial has then proved itself: it commits, and
// its guard stands down.
func (u *Upgrader) Healthy() {
	u.mu.Lock()
	t := u.trial
	u.trial = nil
	u.mu.Unlock()
	if t == nil {
		return
	}
	t.Committed = true
	if err := writeJSON(filepath.Join(u.cfg.Dir, trialFile), t); err != nil {
		u.log.Error("cannot commit the upgrade; the guard will roll it back", "err", err)
		return
	}
	out := outcome{Target: t.Target, Step: StepDone, Detail: "reconnected as " + t.Target, RolloutID: t.RolloutID, Attempt: t.Attempt,
		SHA256: t.SHA256, At: time.Now()}
	if err := writeJSON(filepath.Join(u.cfg.Dir, outcomeFile), out); err != nil {
		u.log.Warn("record the upgrade's outcome", "err", err)
	}
	u.log.Info("upgrade done", "from", t.From, "to", t.Target)
	u.set(out.status())
}

func (u *Upgrader) set(s *eitriv1.AgentUpgradeStatus) {
	u.mu.Lock()
	u.status = s
	u.mu.Unlock()
}

// Run takes offers until ctx ends, or until a new build is in place: then
// it returns a *Restart and the agent hands the process over (Exec).
func (u *Upgrader) Run(ctx context.Context) error {
	var (
		cancel  context.CancelFunc
		working string // the key of the offer in progress
		done    = make(chan error, 1)
	)
	defer func() {
		if cancel != nil {
			cancel()
		}
	}()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case err := <-done:
			cancel, working = nil, ""
			var r *Restart
			if errors.As(err, &r) {
				return err
			}
		case <-u.offers:
		}
		u.mu.Lock()
		o := u.want
		u.mu.Unlock()
		k := ""
		if o != nil {
			k = key(o.GetRolloutId(), o.GetAttempt(), o.GetSha256())
		}
		if k == working {
			continue
		}
		if cancel != nil {
			// Withdrawn, or replaced by another offer: stop what is
			// running; the next pass starts the new one.
			cancel()
			<-done
			cancel, working = nil, ""
		}
		if o == nil || o.GetVersion() == u.cfg.Version || u.isRefused(k) {
			continue
		}
		wctx, c := context.WithCancel(ctx)
		cancel, working = c, k
		go func() { done <- u.take(wctx, o) }()
	}
}

func (u *Upgrader) isRefused(k string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.refused[k]
}

// take carries one offer through; a failure is reported and the offer is
// not taken again.
func (u *Upgrader) take(ctx context.Context, o *eitriv1.AgentUpgrade) error {
	err := u.install(ctx, o)
	var r *Restart
	switch {
	case err == nil, errors.As(err, &r):
		return err
	case ctx.Err() != nil:
		return nil // withdrawn: nothing failed
	}
	u.log.Error("upgrade refused", "version", o.GetVersion(), "err", err)
	out := outcome{Target: o.GetVersion(), Step: StepFailed, Detail: err.Error(), Error: err.Error(), RolloutID: o.GetRolloutId(),
		Attempt: o.GetAttempt(), SHA256: o.GetSha256(), At: time.Now()}
	if werr := writeJSON(filepath.Join(u.cfg.Dir, outcomeFile), out); werr != nil {
		u.log.Warn("record the upgrade's outcome", "err", werr)
	}
	u.mu.Lock()
	u.refused[key(o.GetRolloutId(), o.GetAttempt(), o.GetSha256())] = true
	u.status = out.status()
	u.mu.Unlock()
	return err
}

func (u *Upgrader) say(o *eitriv1.AgentUpgrade, step, detail string, p *eitriv1.Progress) {
	u.mu.Lock()
	defer u.mu.Unlock()
	since := time.Now().Unix()
	if u.status != nil && u.status.GetStep() == step && u.status.GetRolloutId() == o.GetRolloutId() && u.status.GetAttempt() == o.GetAttempt() {
		since = u.status.GetSinceUnix()
	}
	u.status = &eitriv1.AgentUpgradeStatus{TargetVersion: o.GetVersion(), Step: step, Detail: detail, Progress: p, SinceUnix: since,
		RolloutId: o.GetRolloutId(), Attempt: o.GetAttempt()}
}

// install is the offer's steps, up to the restart.
func (u *Upgrader) install(ctx context.Context, o *eitriv1.AgentUpgrade) error {
	v := o.GetVersion()
	if o.GetOs() != runtime.GOOS || o.GetArch() != runtime.GOARCH {
		return fmt.Errorf("refused: the build is for %s/%s and this host is %s/%s", o.GetOs(), o.GetArch(), runtime.GOOS, runtime.GOARCH)
	}
	if u.cfg.Key.IsZero() {
		return errors.New("refused: this host trusts no release key (enroll it with a join token that carries one, or start the agent with --release-key)")
	}
	sig := release.Signature{Build: release.Build{Version: v, OS: o.GetOs(), Arch: o.GetArch(), SHA256: o.GetSha256(), Size: o.GetSize()},
		KeyID: o.GetKeyId(), Sig: o.GetSignature()}
	// Before a byte is fetched: a signature that cannot be this key's is
	// refused without a download.
	if err := u.cfg.Key.Verify(sig); err != nil {
		return fmt.Errorf("refused: %w", err)
	}
	partial := filepath.Join(u.cfg.Dir, o.GetSha256()+".partial")
	total := uint64(o.GetSize())
	u.say(o, StepDownloading, downloadDetail(v, 0, o.GetSize()), &eitriv1.Progress{Step: "download", TotalBytes: &total})
	// A download cut off is resumed where it stopped, a few times, before
	// the offer counts as failed.
	var err error
	for attempt, wait := 1, u.cfg.RetryWait; ; attempt, wait = attempt+1, wait*2 {
		err = fetch(ctx, u.cfg.Client, strings.TrimSuffix(u.cfg.BaseURL(), "/")+o.GetUrl(), u.cfg.Credential, partial, o.GetSize(), func(done int64) {
			u.say(o, StepDownloading, downloadDetail(v, done, o.GetSize()), &eitriv1.Progress{Step: "download", DoneBytes: uint64(done), TotalBytes: &total})
		})
		if err == nil || ctx.Err() != nil || attempt == fetchAttempts {
			break
		}
		u.log.Warn("agent download cut off; resuming", "version", v, "attempt", attempt, "err", err)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	if err != nil {
		return fmt.Errorf("download agent %s: %w", v, err)
	}
	u.say(o, StepVerifying, "verifying signature", nil)
	if err := u.cfg.Key.VerifyFile(sig, partial); err != nil {
		// What was fetched is not the build: fetch it anew next time.
		_ = os.Remove(partial)
		return fmt.Errorf("refused: %w", err)
	}
	staged := filepath.Join(u.cfg.Dir, "eitri-"+v)
	if err := os.Chmod(partial, 0o755); err != nil {
		return err
	}
	if err := os.Rename(partial, staged); err != nil {
		return err
	}
	u.say(o, StepTesting, "testing agent "+v, nil)
	if err := u.probe(ctx, staged, v); err != nil {
		return err
	}
	u.say(o, StepRestarting, "restarting into agent "+v, nil)
	if err := u.swap(o, staged); err != nil {
		return err
	}
	return &Restart{Exe: u.cfg.Exe, Version: v}
}

// probeWaitDelay bounds the wait for a killed probe's output to close.
const probeWaitDelay = 2 * time.Second

// probe runs the new build once and requires it to say the version it was
// offered as, before anything is swapped.
func (u *Upgrader) probe(ctx context.Context, path, version string) error {
	ctx, cancel := context.WithTimeout(ctx, u.cfg.ProbeTimeout)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, path, "version")
	cmd.Stdout, cmd.Stderr = &out, &out
	// A build that hangs may have started children that hold its output
	// open after it is killed: stop waiting for them soon after.
	cmd.WaitDelay = probeWaitDelay
	err := cmd.Run()
	said := strings.TrimSpace(out.String())
	if len(said) > 200 {
		said = said[:200] + "…"
	}
	switch {
	case err != nil:
		return fmt.Errorf("agent %s does not run here: %v (it said %q)", version, err, said)
	case said != "eitri version "+version:
		return fmt.Errorf("the build offered as %s says %q", version, said)
	}
	return nil
}

// swap keeps a copy of the running build, puts the new one in its place by
// one rename, writes the trial down and starts the guard.
func (u *Upgrader) swap(o *eitriv1.AgentUpgrade, staged string) error {
	previous := filepath.Join(u.cfg.Dir, "eitri.previous")
	if err := copyFile(u.cfg.Exe, previous); err != nil {
		return fmt.Errorf("keep the previous build: %w", err)
	}
	wd, _ := os.Getwd()
	now := time.Now()
	t := trial{Target: o.GetVersion(), From: u.cfg.Version, RolloutID: o.GetRolloutId(), Attempt: o.GetAttempt(), SHA256: o.GetSha256(),
		Exe: u.cfg.Exe, Previous: previous, PID: os.Getpid(), Started: now, Deadline: now.Add(u.cfg.HealthBound),
		Args: os.Args, Env: os.Environ(), Dir: wd}
	if err := writeJSON(filepath.Join(u.cfg.Dir, trialFile), t); err != nil {
		return err
	}
	if err := copyFile(staged, u.cfg.Exe); err != nil {
		_ = os.Remove(filepath.Join(u.cfg.Dir, trialFile))
		return fmt.Errorf("put the new build in place: %w", err)
	}
	if err := startGuard(previous, u.cfg.Dir); err != nil {
		// Without a guard nothing would roll a broken build back: undo.
		_ = copyFile(previous, u.cfg.Exe)
		_ = os.Remove(filepath.Join(u.cfg.Dir, trialFile))
		return fmt.Errorf("start the upgrade guard: %w", err)
	}
	u.log.Info("restarting into the new build", "from", u.cfg.Version, "to", o.GetVersion(), "exe", u.cfg.Exe)
	return nil
}

// copyFile replaces dst with src's content by a rename, so dst is always
// one whole build. Executable.
func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	tmp := dst + ".new"
	out, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	if err := out.Sync(); err != nil {
		out.Close()
		return err
	}
	if err := out.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, dst); err != nil {
		return err
	}
	return syncDir(filepath.Dir(dst))
}

// downloadDetail is the download's sentence: "downloading agent v1.4 12/40
// MiB".
func downloadDetail(version string, done, total int64) string {
	return fmt.Sprintf("downloading agent %s %d/%d MiB", version, done>>20, (total+(1<<20)-1)>>20)
}
