package fleet

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/bounds"
	"github.com/a73x/eitri/wire/release"
)

// The steps of an agent's upgrade the control plane acts on
// (AgentUpgradeStatus.step); the rest are narration.
const (
	// UpgradeOffered: offered, and the host has said nothing of it yet.
	UpgradeOffered = "offered"
	UpgradeDone    = "done"
	UpgradeFailed  = "failed"
)

// Host conditions about the agent itself.
const (
	ConditionUpgradeStuck = "upgrade_stuck"
	ConditionVersionSkew  = "version_skew"
)

// DefaultStuckAfter is how long a connected host may stay on its old version
// after an offer before it is called stuck.
const DefaultStuckAfter = 5 * time.Minute

// rollouts is this replica's view of the newest rollout, refreshed on every
// change it makes and on every tick (another replica's changes).
type rollouts struct {
	mu     sync.Mutex
	latest *store.Rollout // nil when there never was one
	wake   chan struct{}
}

func (r *rollouts) get() *store.Rollout {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.latest
}

// set records ro as the newest rollout and reports whether it is news.
func (r *rollouts) set(ro store.Rollout) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.latest != nil && r.latest.ID == ro.ID && r.latest.UpdatedAt.Equal(ro.UpdatedAt) && r.latest.State == ro.State {
		return false
	}
	if r.latest != nil && r.latest.ID != ro.ID && r.latest.CreatedAt.After(ro.CreatedAt) {
		return false
	}
	r.latest = &ro
	return true
}

// wakeRollouts asks the rollout loop to take a step now (a host said
// something that may move the rollout).
func (f *Fleet) wakeRollouts() {
	select {
	case f.rollouts.wake <- struct{}{}:
	default:
	}
}

// StartRollout upgrades the named hosts (or all) to a version: a canary
// first, then waves. Every host must have a build for its platform, and a
// host on a newer version refuses the whole rollout unless a downgrade is
// asked for: it is the one mistake that is hard to see in a list.
func (f *Fleet) StartRollout(ctx context.Context, r *eitriv1.StartRolloutRequest) (*eitriv1.Rollout, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, err
	}
	version := r.GetVersion()
	if version == "" {
		return nil, invalid("version", "required")
	}
	if err := checkLen("version", version, 64); err != nil {
		return nil, err
	}
	var hosts []store.Host
	switch {
	case r.GetAll() && len(r.GetHostIds()) > 0:
		return nil, invalid("host_ids", "name hosts or ask for all, not both")
	case r.GetAll():
		if hosts, err = f.st.ListHosts(ctx); err != nil {
			return nil, err
		}
	default:
		seen := map[string]bool{}
		for _, id := range r.GetHostIds() {
			if seen[id] {
				continue
			}
			seen[id] = true
			h, err := f.hostByID(ctx, id)
			if err != nil {
				return nil, err
			}
			hosts = append(hosts, h)
		}
	}
	if len(hosts) == 0 {
		return nil, invalid("host_ids", "no hosts to upgrade")
	}
	var todo, there []store.RolloutHost
	for _, h := range hosts {
		if h.AgentVersion == version {
			now := f.now()
			there = append(there, store.RolloutHost{HostID: h.ID, HostName: h.Name, State: store.HostDone, FromVersion: h.AgentVersion, FinishedAt: &now})
			continue
		}
		if h.OS == "" || h.Arch == "" {
			return nil, errorf(Precondition, "host %s has not said which platform it runs (its agent predates upgrades, or never connected); upgrade it by hand", h.Name)
		}
		if _, err := f.st.ReleaseFor(ctx, version, h.OS, h.Arch); err != nil {
			return nil, errorf(Precondition, "no build of %s for %s/%s is held (host %s); upload one with eitri release upload", version, h.OS, h.Arch, h.Name)
		}
		if c, ok := release.CompareVersions(h.AgentVersion, version); ok && c > 0 && !r.GetAllowDowngrade() {
			return nil, errorf(Precondition, "host %s runs %s, newer than %s: a downgrade must be asked for (--allow-downgrade)", h.Name, h.AgentVersion, version)
		}
		todo = append(todo, store.RolloutHost{HostID: h.ID, HostName: h.Name, State: store.HostPending, FromVersion: h.AgentVersion})
	}
	maxUn := max(1, int(r.GetMaxUnavailable()))
	ro := store.Rollout{ID: newID("ro"), Version: version, State: store.RolloutCanary, MaxUnavailable: maxUn,
		AllowDowngrade: r.GetAllowDowngrade(), Hosts: append(todo, there...), CreatedBy: p.UserID, CreatedAt: f.now()}
	if len(todo) == 0 {
		ro.State = store.RolloutDone
	}
	if err := f.st.CreateRollout(ctx, ro); err != nil {
		return nil, storeErr(err, "rollout")
	}
	f.log.Info("rollout started", "rollout", ro.ID, "version", version, "hosts", len(ro.Hosts), "max_unavailable", maxUn)
	ro, err = f.stepRollout(ctx, ro.ID)
	if err != nil {
		return nil, err
	}
	return rolloutView(ro), nil
}

// GetRollout returns one rollout, or the newest with an empty id.
func (f *Fleet) GetRollout(ctx context.Context, id string) (*eitriv1.Rollout, error) {
	if _, err := principal(ctx); err != nil {
		return nil, err
	}
	ro, err := f.rolloutByID(ctx, id)
	if err != nil {
		return nil, err
	}
	return rolloutView(ro), nil
}

func (f *Fleet) rolloutByID(ctx context.Context, id string) (store.Rollout, error) {
	if id == "" {
		list, err := f.st.ListRollouts(ctx)
		if err != nil {
			return store.Rollout{}, err
		}
		if len(list) == 0 {
			return store.Rollout{}, errorf(NotFound, "no rollout yet")
		}
		return list[0], nil
	}
	if err := checkLen("id", id, bounds.MaxIDLen); err != nil {
		return store.Rollout{}, err
	}
	ro, err := f.st.GetRollout(ctx, id)
	return ro, storeErr(err, "rollout "+id)
}

// ListRollouts returns every rollout, newest first.
func (f *Fleet) ListRollouts(ctx context.Context) ([]*eitriv1.Rollout, error) {
	if _, err := principal(ctx); err != nil {
		return nil, err
	}
	list, err := f.st.ListRollouts(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*eitriv1.Rollout, len(list))
	for i, ro := range list {
		out[i] = rolloutView(ro)
	}
	return out, nil
}

// PauseRollout lets hosts already upgrading finish and starts no more.
func (f *Fleet) PauseRollout(ctx context.Context, id string) (*eitriv1.Rollout, error) {
	return f.changeRollout(ctx, id, func(p string, ro *store.Rollout) error {
		if ro.State != store.RolloutCanary && ro.State != store.RolloutRolling {
			return errorf(Precondition, "rollout %s is %s, not running", ro.ID, ro.State)
		}
		ro.State, ro.Reason = store.RolloutPaused, "paused by "+p
		return nil
	})
}

// ResumeRollout goes on with a paused or halted rollout. The host that
// halted it is offered the build again (a new attempt): resuming is how an
// admin says the cause is fixed.
func (f *Fleet) ResumeRollout(ctx context.Context, id string) (*eitriv1.Rollout, error) {
	return f.changeRollout(ctx, id, func(_ string, ro *store.Rollout) error {
		if ro.State != store.RolloutPaused && ro.State != store.RolloutHalted {
			return errorf(Precondition, "rollout %s is %s; only a paused or halted rollout resumes", ro.ID, ro.State)
		}
		for i := range ro.Hosts {
			if h := &ro.Hosts[i]; h.State == store.HostFailed {
				h.State, h.FinishedAt = store.HostPending, nil
			}
		}
		ro.State, ro.Reason = store.RolloutRolling, ""
		if len(ro.Hosts) > 0 && ro.Hosts[0].State != store.HostDone {
			ro.State = store.RolloutCanary
		}
		return nil
	})
}

// AbortRollout ends a rollout: hosts not yet done are withdrawn.
func (f *Fleet) AbortRollout(ctx context.Context, id string) (*eitriv1.Rollout, error) {
	return f.changeRollout(ctx, id, func(p string, ro *store.Rollout) error {
		if !store.RolloutActive(ro.State) {
			return errorf(Precondition, "rollout %s is already %s", ro.ID, ro.State)
		}
		now := f.now()
		for i := range ro.Hosts {
			if h := &ro.Hosts[i]; h.State == store.HostPending || h.State == store.HostUpgrading {
				h.State, h.FinishedAt = store.HostSkipped, &now
			}
		}
		ro.State, ro.Reason = store.RolloutAborted, "aborted by "+p
		return nil
	})
}

// changeRollout applies an admin's change and then takes a step.
func (f *Fleet) changeRollout(ctx context.Context, id string, fn func(who string, ro *store.Rollout) error) (*eitriv1.Rollout, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, err
	}
	cur, err := f.rolloutByID(ctx, id)
	if err != nil {
		return nil, err
	}
	who := p.UserID
	if u, err := f.st.UserByID(ctx, p.UserID); err == nil {
		who = u.Name
	}
	ro, changed, err := f.st.UpdateRollout(ctx, cur.ID, func(ro *store.Rollout) error { return fn(who, ro) })
	if err != nil {
		return nil, storeErr(err, "rollout "+cur.ID)
	}
	if changed {
		f.log.Info("rollout changed", "rollout", ro.ID, "state", ro.State, "reason", ro.Reason)
		f.rolloutChanged(ctx, cur, ro)
	}
	if ro, err = f.stepRollout(ctx, ro.ID); err != nil {
		return nil, err
	}
	return rolloutView(ro), nil
}

// hostFacts is what the rollout reads of a host.
type hostFacts struct {
	version string
	upgrade store.HostUpgrade
}

// stepRollout moves a rollout as far as its hosts allow, in one store
// update: any replica may take the step, and two taking it at once agree.
func (f *Fleet) stepRollout(ctx context.Context, id string) (store.Rollout, error) {
	hosts, err := f.st.ListHosts(ctx)
	if err != nil {
		return store.Rollout{}, err
	}
	facts := make(map[string]hostFacts, len(hosts))
	for _, h := range hosts {
		facts[h.ID] = hostFacts{version: h.AgentVersion, upgrade: h.Upgrade}
	}
	now := f.now()
	var before store.Rollout
	ro, changed, err := f.st.UpdateRollout(ctx, id, func(ro *store.Rollout) error {
		before = *ro
		before.Hosts = append([]store.RolloutHost(nil), ro.Hosts...)
		advance(ro, facts, now)
		return nil
	})
	if err != nil {
		return store.Rollout{}, storeErr(err, "rollout "+id)
	}
	if changed {
		if ro.State != before.State {
			f.log.Info("rollout", "rollout", ro.ID, "state", ro.State, "reason", ro.Reason)
		}
		f.rolloutChanged(ctx, before, ro)
	} else {
		f.rollouts.set(ro)
	}
	return ro, nil
}

// advance is the rollout's rule, from the hosts' facts: a host is done once
// it runs the version (it reconnected as it), failed once it says so for
// this attempt; the first failure halts the rollout; the canary goes alone,
// then at most MaxUnavailable hosts upgrade at once.
func advance(ro *store.Rollout, facts map[string]hostFacts, now time.Time) {
	if !store.RolloutActive(ro.State) {
		return
	}
	for i := range ro.Hosts {
		h := &ro.Hosts[i]
		if h.State != store.HostUpgrading {
			continue
		}
		hf, ok := facts[h.HostID]
		switch {
		case !ok:
			h.State, h.Error, h.FinishedAt = store.HostFailed, "the host left the fleet", &now
		case hf.version == ro.Version:
			h.State, h.Error, h.FinishedAt = store.HostDone, "", &now
		case hf.upgrade.RolloutID == ro.ID && hf.upgrade.Attempt == h.Attempt && hf.upgrade.Step == UpgradeFailed:
			h.State, h.Error, h.FinishedAt = store.HostFailed, hf.upgrade.Error, &now
		}
	}
	if ro.State == store.RolloutPaused || ro.State == store.RolloutHalted {
		return
	}
	for _, h := range ro.Hosts {
		if h.State == store.HostFailed {
			ro.State = store.RolloutHalted
			ro.Reason = fmt.Sprintf("host %s failed to upgrade: %s", h.HostName, h.Error)
			return
		}
	}
	start := func(h *store.RolloutHost) {
		h.State, h.Error, h.StartedAt, h.FinishedAt = store.HostUpgrading, "", &now, nil
		h.Attempt++
		if hf, ok := facts[h.HostID]; ok {
			h.FromVersion = hf.version
		}
	}
	if ro.State == store.RolloutCanary && len(ro.Hosts) > 0 {
		switch c := &ro.Hosts[0]; c.State {
		case store.HostPending:
			start(c)
			return
		case store.HostUpgrading:
			return
		}
		ro.State = store.RolloutRolling
	}
	inflight, pending := 0, 0
	for _, h := range ro.Hosts {
		if h.State == store.HostUpgrading {
			inflight++
		}
	}
	for i := range ro.Hosts {
		h := &ro.Hosts[i]
		if h.State != store.HostPending {
			continue
		}
		if inflight < ro.MaxUnavailable {
			start(h)
			inflight++
			continue
		}
		pending++
	}
	if inflight == 0 && pending == 0 {
		ro.State, ro.Reason = store.RolloutDone, ""
	}
}

// rolloutChanged tells watchers, the hosts whose part changed, and their
// streams (an offer made or withdrawn).
func (f *Fleet) rolloutChanged(ctx context.Context, before, after store.Rollout) {
	f.rollouts.set(after)
	f.Rollouts.Publish(watch.Event[*eitriv1.Rollout]{ID: after.ID, Obj: rolloutView(after)})
	was := map[string]store.RolloutHost{}
	for _, h := range before.Hosts {
		was[h.HostID] = h
	}
	for _, h := range after.Hosts {
		if b, ok := was[h.HostID]; ok && b.State == h.State && b.Attempt == h.Attempt && before.State == after.State {
			continue
		}
		f.publishHost(ctx, h.HostID)
		f.kick(h.HostID)
	}
}

// RunRollouts takes the active rollout's steps as hosts report, and every
// tick: it catches another replica's changes and the clock (a host turning
// stuck), and re-offers to this replica's hosts what their rollout says.
func (f *Fleet) RunRollouts(ctx context.Context) {
	t := time.NewTicker(f.cfg.RolloutTick)
	defer t.Stop()
	if err := f.refreshReleases(ctx); err != nil {
		f.log.Warn("read releases", "err", err)
	}
	for {
		f.rolloutTick(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-f.rollouts.wake:
		}
	}
}

func (f *Fleet) rolloutTick(ctx context.Context) {
	list, err := f.st.ListRollouts(ctx)
	if err != nil || len(list) == 0 {
		return
	}
	latest := list[0]
	prev := f.rollouts.get()
	if store.RolloutActive(latest.State) {
		if latest, err = f.stepRollout(ctx, latest.ID); err != nil {
			f.log.Warn("rollout step", "rollout", list[0].ID, "err", err)
			return
		}
	} else if f.rollouts.set(latest) {
		// Another replica ended it: publish what it says now.
		var before store.Rollout
		if prev != nil {
			before = *prev
		}
		f.rolloutChanged(ctx, before, latest)
	}
	// Streams here whose offer differs from what the rollout now says get a
	// fresh snapshot; hosts turning stuck get their row republished.
	for _, h := range latest.Hosts {
		want := ""
		if store.RolloutActive(latest.State) && h.State == store.HostUpgrading {
			want = offerKey(latest.ID, h.Attempt)
		}
		f.mu.Lock()
		s := f.sessions[h.HostID]
		stale := s != nil && s.offered != want
		f.mu.Unlock()
		if stale {
			f.kick(h.HostID)
		}
		if h.State == store.HostUpgrading && h.StartedAt != nil {
			if age := f.now().Sub(*h.StartedAt); age >= f.cfg.StuckAfter && age < f.cfg.StuckAfter+2*f.cfg.RolloutTick {
				f.publishHost(ctx, h.HostID)
			}
		}
	}
}

func offerKey(rolloutID string, attempt uint64) string {
	return fmt.Sprintf("%s/%d", rolloutID, attempt)
}

// upgradeOffer is the offer a host's snapshot carries: the build of the
// active rollout's version for the host's platform, while the rollout has
// the host upgrading. Nil otherwise.
func (f *Fleet) upgradeOffer(ctx context.Context, hostID string) (*eitriv1.AgentUpgrade, string, error) {
	ro, ok, err := f.st.ActiveRollout(ctx)
	if err != nil || !ok {
		return nil, "", err
	}
	var entry *store.RolloutHost
	for i := range ro.Hosts {
		if ro.Hosts[i].HostID == hostID {
			entry = &ro.Hosts[i]
		}
	}
	if entry == nil || entry.State != store.HostUpgrading {
		return nil, "", nil
	}
	h, err := f.st.HostByID(ctx, hostID)
	if err != nil {
		return nil, "", err
	}
	rel, err := f.st.ReleaseFor(ctx, ro.Version, h.OS, h.Arch)
	if err != nil {
		// Deleted under the rollout: nothing to offer; the host stays
		// upgrading and is shown stuck.
		return nil, "", nil
	}
	sig, err := release.ParseSignature(rel.Signature)
	if err != nil {
		return nil, "", err
	}
	return &eitriv1.AgentUpgrade{
		Version: rel.Version, Url: "/releases/" + rel.SHA256, Sha256: rel.SHA256, Os: rel.OS, Arch: rel.Arch, Size: rel.Size,
		Signature: sig.Sig, KeyId: rel.KeyID, RolloutId: ro.ID, Attempt: entry.Attempt,
	}, offerKey(ro.ID, entry.Attempt), nil
}

// noteUpgrade records what an agent said of its upgrade when it is news for
// the rollout (a step, not progress), and wakes the rollout.
func (s *Session) noteUpgrade(ctx context.Context, u *eitriv1.AgentUpgradeStatus) {
	if u == nil {
		return
	}
	rec := store.HostUpgrade{Target: u.GetTargetVersion(), Step: u.GetStep(), Error: u.GetError(),
		RolloutID: u.GetRolloutId(), Attempt: u.GetAttempt(), Since: time.Unix(u.GetSinceUnix(), 0).UTC()}
	f := s.f
	f.mu.Lock()
	same := s.upgrade == rec
	s.upgrade = rec
	f.mu.Unlock()
	if same {
		return
	}
	if err := f.st.SetHostUpgrade(ctx, s.hostID, rec); err != nil {
		f.log.Warn("record host upgrade", "host", s.hostID, "err", err)
		return
	}
	if rec.Step == UpgradeFailed {
		f.log.Warn("host upgrade failed", "host", s.hostID, "target", rec.Target, "err", rec.Error)
	}
	f.wakeRollouts()
}

// hostUpgradeView is a host's upgrade as the API shows it: the newest
// rollout's part for the host, what the host last said of it, and whether
// it is stuck.
func (f *Fleet) hostUpgradeView(h store.Host, connected bool, live *eitriv1.AgentUpgradeStatus) (*eitriv1.HostUpgrade, *eitriv1.HostCondition) {
	var out *eitriv1.HostUpgrade
	var entry *store.RolloutHost
	ro := f.rollouts.get()
	if ro != nil {
		for i := range ro.Hosts {
			if ro.Hosts[i].HostID == h.ID {
				entry = &ro.Hosts[i]
			}
		}
	}
	said := h.Upgrade
	if connected && live != nil {
		// What the host says right now is newer than what was written.
		said = store.HostUpgrade{Target: live.GetTargetVersion(), Step: live.GetStep(), Error: live.GetError(),
			RolloutID: live.GetRolloutId(), Attempt: live.GetAttempt(), Since: time.Unix(live.GetSinceUnix(), 0).UTC()}
	}
	switch {
	case entry != nil && entry.State != store.HostPending && entry.State != store.HostSkipped:
		out = &eitriv1.HostUpgrade{Target: ro.Version, RolloutId: ro.ID}
		switch {
		case said.RolloutID == ro.ID && said.Attempt == entry.Attempt && said.Step != "":
			out.Step, out.Error, out.Since = said.Step, said.Error, timestamppb.New(said.Since)
		case entry.State == store.HostDone:
			out.Step = UpgradeDone
		case entry.State == store.HostFailed:
			out.Step, out.Error = UpgradeFailed, entry.Error
		default:
			out.Step = UpgradeOffered
		}
		if out.Since == nil && entry.StartedAt != nil {
			out.Since = timestamppb.New(*entry.StartedAt)
		}
	case said.Target != "":
		out = &eitriv1.HostUpgrade{Target: said.Target, Step: said.Step, Error: said.Error, RolloutId: said.RolloutID,
			Since: timestamppb.New(said.Since)}
	default:
		return nil, nil
	}
	if connected && live != nil && live.GetTargetVersion() == out.Target {
		out.Detail, out.Progress = live.GetDetail(), live.GetProgress()
	}
	// Stuck: offered, connected, and still on the old version past the
	// bound. An offline host cannot take an offer; it is offline.
	if entry == nil || entry.State != store.HostUpgrading || entry.StartedAt == nil || !connected || h.AgentVersion == ro.Version {
		return out, nil
	}
	age := f.now().Sub(*entry.StartedAt)
	if age < f.cfg.StuckAfter {
		return out, nil
	}
	out.Stuck = true
	msg := fmt.Sprintf("stuck: offered %s %s ago, still on %s", ro.Version, humanAge(age), orUnknown(h.AgentVersion))
	if out.Step != UpgradeOffered && out.Step != "" {
		msg += " (last step: " + out.Step + ")"
	}
	return out, &eitriv1.HostCondition{Type: ConditionUpgradeStuck, Message: msg,
		Since: timestamppb.New(entry.StartedAt.Add(f.cfg.StuckAfter)), LastSeenAt: timestamppb.New(f.now())}
}

// versionSkew says when a host's agent is older than this control plane: one
// minor version is supported, more is not. Unnumbered versions (dev builds)
// say nothing.
func (f *Fleet) versionSkew(h store.Host) *eitriv1.HostCondition {
	n := release.MinorsBehind(h.AgentVersion, f.cfg.Version)
	if n == 0 {
		return nil
	}
	msg := fmt.Sprintf("agent %s is one version behind the control plane (%s), which is supported; upgrade it with eitri host upgrade", h.AgentVersion, f.cfg.Version)
	if n > 1 {
		msg = fmt.Sprintf("agent %s is more than one version behind the control plane (%s), which is not supported; upgrade it with eitri host upgrade", h.AgentVersion, f.cfg.Version)
	}
	return &eitriv1.HostCondition{Type: ConditionVersionSkew, Message: msg}
}

func orUnknown(v string) string {
	if v == "" {
		return "an unknown version"
	}
	return v
}

// humanAge is a duration as people say it: "45 s", "6 min", "3 h".
func humanAge(d time.Duration) string {
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%d s", int(d.Seconds()))
	case d < time.Hour:
		return fmt.Sprintf("%d min", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%d h", int(d.Hours()))
	}
	return fmt.Sprintf("%d days", int(d.Hours()/24))
}

func rolloutView(ro store.Rollout) *eitriv1.Rollout {
	out := &eitriv1.Rollout{Id: ro.ID, Version: ro.Version, State: ro.State, Reason: ro.Reason, MaxUnavailable: uint32(ro.MaxUnavailable),
		AllowDowngrade: ro.AllowDowngrade, CreatedAt: timestamppb.New(ro.CreatedAt), UpdatedAt: timestamppb.New(ro.UpdatedAt), CreatedBy: ro.CreatedBy}
	for _, h := range ro.Hosts {
		v := &eitriv1.RolloutHost{HostId: h.HostID, HostName: h.HostName, State: h.State, FromVersion: h.FromVersion, Error: h.Error, Attempt: h.Attempt}
		if h.StartedAt != nil {
			v.StartedAt = timestamppb.New(*h.StartedAt)
		}
		if h.FinishedAt != nil {
			v.FinishedAt = timestamppb.New(*h.FinishedAt)
		}
		out.Hosts = append(out.Hosts, v)
	}
	return out
}

// WatchRollouts subscribes and returns every rollout to start from.
func (f *Fleet) WatchRollouts(ctx context.Context) (*watch.Watcher[*eitriv1.Rollout], []*eitriv1.Rollout, error) {
	if _, err := principal(ctx); err != nil {
		return nil, nil, err
	}
	w := f.Rollouts.Subscribe(nil)
	list, err := f.ListRollouts(ctx)
	if err != nil {
		w.Close()
		return nil, nil, err
	}
	return w, list, nil
}
