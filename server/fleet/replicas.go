package fleet

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/registry"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
)

// Several replicas on one PostgreSQL. The database is the truth and a
// replica's memory a cache of it: durable writes reach other replicas
// through the store's change feed, and a host's live word (narration,
// progress, counters, connected or not) through host_live, written by the
// replica holding the host's stream. Each replica follows both from the
// revision it has reached, woken by NOTIFY and, since notifications get
// lost, by a timer as well; one that was away longer than the feed is kept
// reads everything anew.

const (
	// claimTTL is how long a replica's claim on a host's stream lasts
	// unrenewed: a dead replica's hosts show disconnected after it, and
	// another agent process may then take the host.
	claimTTL = 15 * time.Second
	// renewEvery renews the claims well inside claimTTL.
	renewEvery = claimTTL / 3
	// liveFlush is how often the reports of hosts held here are shared: a
	// watcher on another replica sees narration this much later at most.
	liveFlush = 15 * time.Millisecond
	// followPoll catches up even when no notification arrives.
	followPoll = time.Second
	// changesKept is how long the change feed is kept; a follower that has
	// not caught up for half of it (resyncAfter) reads everything anew.
	changesKept = 10 * time.Minute
	resyncAfter = changesKept / 2
	changeBatch = 500
)

// replicas is the fleet's side of the other replicas.
type replicas struct {
	mu sync.Mutex
	// mirrors: hosts whose stream another replica holds, as mirrored into
	// this replica's registry.
	mirrors map[string]mirror
	// dirty: hosts held here whose report other replicas have not seen.
	dirty map[string]*Session
	// usage: the newest usage sample of hosts held here, marshalled, not
	// yet written for the other replicas.
	usage map[string][]byte
	// applied: the usage sample last taken from each mirrored host's row,
	// so a row rewritten for its report adds no sample twice.
	applied map[string][]byte
	flush   chan struct{}
}

type mirror struct {
	remote int64  // the holder's conn (host_live.conn)
	local  uint64 // the registry connection standing for it here
}

// shareReport queues the host's latest report for the other replicas.
func (f *Fleet) shareReport(s *Session) {
	if !f.st.Shared() {
		return
	}
	f.replicas.queue(s, nil)
}

// shareUsage queues the host's newest usage sample for the other replicas,
// whose watchers chart it too.
func (f *Fleet) shareUsage(s *Session, u *eitriv1.UsageSample) {
	if !f.st.Shared() {
		return
	}
	b, err := proto.Marshal(u)
	if err != nil {
		return
	}
	f.replicas.queue(s, b)
}

// queue marks the host's row for the next write, with usage when a new
// sample came.
func (r *replicas) queue(s *Session, usage []byte) {
	r.mu.Lock()
	if r.dirty == nil {
		r.dirty = map[string]*Session{}
	}
	r.dirty[s.hostID] = s
	if usage != nil {
		if r.usage == nil {
			r.usage = map[string][]byte{}
		}
		r.usage[s.hostID] = usage
	}
	r.mu.Unlock()
	select {
	case r.flush <- struct{}{}:
	default:
	}
}

// claimHost makes this replica the holder of the host's stream fleet-wide,
// or refuses a second agent process as refuseDuplicate does on one replica.
func (f *Fleet) claimHost(ctx context.Context, hostID string, hello *eitriv1.Hello, peer string) (int64, error) {
	if !f.st.Shared() {
		return 0, nil
	}
	b, err := proto.Marshal(hello)
	if err != nil {
		return 0, err
	}
	conn, err := f.st.ClaimHost(ctx, hostID, hello.GetInstanceId(), b, claimTTL)
	if errors.Is(err, store.ErrHeld) {
		f.noteDuplicate(ctx, hostID, hello.GetInstanceId(), peer, "another replica", f.now())
		return 0, errorf(Precondition, "host %s already has an agent connected through another control-plane replica; two agents share this host's identity. "+
			"If this machine is a copy of that host (a cloned disk), stop this agent, delete its data dir and enroll it with a new join token "+
			"(eitri host join-token). If that agent is gone, this one is let in once its claim lapses (within %s).", hostID, claimTTL)
	}
	if err != nil {
		return 0, err
	}
	// A stream here replaces whatever this replica mirrored for the host.
	f.replicas.mu.Lock()
	delete(f.replicas.mirrors, hostID)
	f.replicas.mu.Unlock()
	return conn, nil
}

// releaseHost says the host's stream here has ended.
func (f *Fleet) releaseHost(ctx context.Context, s *Session) {
	if !f.st.Shared() || s.claim == 0 {
		return
	}
	if err := f.st.ReleaseHost(ctx, s.hostID, s.claim); err != nil {
		f.log.Warn("release the host's stream claim", "host", s.hostID, "err", err)
	}
}

// FollowReplicas keeps this replica in step with the others sharing its
// database until ctx ends: their durable writes and their hosts' live
// state reach this replica's watchers and host streams, and the reports of
// hosts held here reach theirs. On SQLite it returns at once.
func (f *Fleet) FollowReplicas(ctx context.Context) {
	if !f.st.Shared() {
		return
	}
	changes := f.st.Listen(ctx, store.ChangesChannel)
	live := f.st.Listen(ctx, store.LiveChannel)
	calls := f.st.Listen(ctx, store.CallsChannel)
	var sharing sync.WaitGroup
	sharing.Go(func() { f.shareLive(ctx) })
	defer sharing.Wait()

	fl := &follower{f: f, hosts: map[string]bool{}}
	poll := time.NewTicker(followPoll)
	defer poll.Stop()
	prune := time.NewTicker(time.Minute)
	defer prune.Stop()
	fl.catchUp(ctx)
	for {
		// A wake-up reads only the feed it is about.
		select {
		case <-ctx.Done():
			return
		case <-calls:
			f.Relay.TakeCalls(ctx)
		case <-changes:
			fl.followChanges(ctx)
		case <-live:
			fl.followLive(ctx)
		case <-poll.C:
			// A wake-up may have been lost, and a dead replica's claims
			// lapse with nobody writing.
			f.Relay.TakeCalls(ctx)
			fl.catchUp(ctx)
		case <-prune.C:
			if _, err := f.st.PruneChanges(ctx, changesKept); err != nil && ctx.Err() == nil {
				f.log.Warn("prune the change feed", "err", err)
			}
		}
	}
}

// shareLive writes the queued reports of hosts held here, and renews the
// claims on them.
func (f *Fleet) shareLive(ctx context.Context) {
	r := &f.replicas
	renew := time.NewTicker(renewEvery)
	defer renew.Stop()
	var last time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-renew.C:
			if err := f.st.RenewClaims(ctx, claimTTL); err != nil && ctx.Err() == nil {
				f.log.Warn("renew the host stream claims", "err", err)
			}
			continue
		case <-r.flush:
		}
		// At most one write per liveFlush, carrying every host's newest: the
		// first after a quiet spell goes at once, later ones wait out the
		// interval.
		if wait := liveFlush - time.Since(last); wait > 0 {
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
		last = time.Now()
		r.mu.Lock()
		dirty, usage := r.dirty, r.usage
		r.dirty, r.usage = nil, nil
		r.mu.Unlock()
		var reps []store.LiveReport
		held := map[string]*Session{}
		for id, s := range dirty {
			live, ok := f.reg.Host(id)
			if !ok || live.Report == nil || s.ctx.Err() != nil {
				continue
			}
			b, err := proto.Marshal(live.Report)
			if err != nil {
				continue
			}
			reps = append(reps, store.LiveReport{HostID: id, Conn: s.claim, Report: b, Usage: usage[id]})
			held[id] = s
		}
		if len(reps) == 0 {
			continue
		}
		lost, err := f.st.WriteLive(ctx, reps, claimTTL)
		if err != nil {
			if ctx.Err() == nil {
				f.log.Warn("share the hosts' reports with the other replicas", "err", err)
				// Try them again with the next flush.
				r.mu.Lock()
				for id, s := range held {
					if r.dirty == nil {
						r.dirty = map[string]*Session{}
					}
					if _, newer := r.dirty[id]; !newer {
						r.dirty[id] = s
					}
					if _, newer := r.usage[id]; !newer && usage[id] != nil {
						if r.usage == nil {
							r.usage = map[string][]byte{}
						}
						r.usage[id] = usage[id]
					}
				}
				r.mu.Unlock()
			}
			continue
		}
		for _, id := range lost {
			// The agent is on another replica now: this stream is stale.
			held[id].cancel(ErrReplaced)
		}
	}
}

// follower is FollowReplicas' position in the feeds.
type follower struct {
	f *Fleet
	// after and liveAfter: the revisions read up to; started: whether
	// after was ever set.
	after, liveAfter int64
	started          bool
	caughtUp         time.Time
	// hosts this follower has published, to tell removals on a resync.
	hosts map[string]bool
}

// catchUp reads both feeds to their ends, and drops the mirrors of hosts
// whose holder's claim lapsed.
func (fl *follower) catchUp(ctx context.Context) {
	fl.followChanges(ctx)
	fl.followLive(ctx)
	expired, err := fl.f.st.LiveExpired(ctx)
	if err != nil {
		fl.warn(ctx, "follow the hosts' live state", err)
		return
	}
	for _, id := range expired {
		fl.dropMirror(ctx, id)
	}
}

// followChanges applies the change feed past fl.after. One that has not
// caught up for resyncAfter may have missed pruned changes, so it reads
// everything anew and goes on from the feed's end.
func (fl *follower) followChanges(ctx context.Context) {
	f := fl.f
	if !fl.started || time.Since(fl.caughtUp) > resyncAfter {
		_, newest, err := f.st.ChangeBounds(ctx)
		if err != nil {
			fl.warn(ctx, "read the change feed's bounds", err)
			return
		}
		if fl.started {
			if err := fl.resync(ctx); err != nil {
				fl.warn(ctx, "read the fleet anew", err)
				return // again on the next wake-up
			}
		}
		fl.after, fl.started = newest, true
	}
	for {
		batch, err := f.st.Changes(ctx, fl.after, changeBatch)
		if err != nil {
			fl.warn(ctx, "follow the change feed", err)
			return
		}
		for _, c := range batch {
			fl.apply(ctx, c)
			fl.after = c.Rev
		}
		if len(batch) < changeBatch {
			break
		}
	}
	fl.caughtUp = time.Now()
}

func (fl *follower) warn(ctx context.Context, what string, err error) {
	if ctx.Err() == nil {
		fl.f.log.Warn(what, "err", err)
	}
}

// apply brings one change made by another replica to this one's watchers
// and, when it is about a host held here, to the host's stream.
func (fl *follower) apply(ctx context.Context, c store.Change) {
	f := fl.f
	if c.Origin == f.st.Replica() {
		return // published when it was written
	}
	switch c.Kind {
	case store.ChangeVM:
		before, known := f.published.vm(c.ID)
		if c.Removed {
			f.vmRemoved(c.ID, c.OwnerID)
		} else {
			// The feed names the row another replica wrote, not its
			// contents: read it.
			f.publishVM(ctx, c.ID)
		}
		f.kick(c.HostID)
		// Most VM writes are a host's report (a status, an address), which
		// leave what the host has allocated as it was: its view is read
		// and sent to every host watcher only when that moved.
		after, still := f.published.vm(c.ID)
		if c.HostID != "" && (!known || !still || allocationMoved(before, after)) {
			f.publishHost(ctx, c.HostID)
		}
	case store.ChangeExposure:
		if c.Removed {
			owner := ""
			if p, ok := f.published.exposure(c.ID); ok {
				owner = p.owner
			}
			f.exposureRemoved(store.Exposure{ID: c.ID}, owner)
		} else {
			f.publishExposure(ctx, c.ID)
		}
		f.kick(c.HostID)
	case store.ChangeSecret:
		if f.cfg.OthersChangedSecrets != nil {
			if err := f.cfg.OthersChangedSecrets(ctx); err != nil {
				f.log.Error("take the SSH CA another replica rotated", "err", err)
			} else {
				f.log.Info("took the SSH CA another replica rotated", "secret", c.ID)
			}
		}
		// Guests seeded from now on trust the new user CA key.
		f.mu.Lock()
		for id := range f.sessions {
			select {
			case f.sessions[id].kicks <- struct{}{}:
			default:
			}
		}
		f.mu.Unlock()
	case store.ChangeImagePull:
		f.kick(c.HostID)
		f.publishImage(ctx, c.ID)
	case store.ChangeImage:
		for _, h := range pulledTo(ctx, f, c.ID) {
			f.kick(h) // the hosts holding it fetch the new version
		}
		f.publishImage(ctx, c.ID)
	case store.ChangeHost:
		fl.hosts[c.ID] = !c.Removed
		if c.Removed {
			f.endHost(c.ID)
			fl.dropMirror(ctx, c.ID)
			f.Hosts.Publish(watch.Event[*eitriv1.Host]{ID: c.ID, Removed: true})
			return
		}
		f.publishHost(ctx, c.ID)
	}
}

// allocationMoved says whether a VM written as b instead of a changes
// what its host has allocated (see vmHolds).
func allocationMoved(a, b store.VM) bool {
	ac, am, ad := vmHolds(a)
	bc, bm, bd := vmHolds(b)
	return a.HostID != b.HostID || ac != bc || am != bm || ad != bd
}

// resync publishes every object anew, and the removal of those published
// before that are gone.
func (fl *follower) resync(ctx context.Context) error {
	f := fl.f
	f.log.Warn("this replica fell behind the change feed; reading the fleet anew")
	vms, err := f.st.ListVMs(ctx, "")
	if err != nil {
		return err
	}
	keepVMs, keepExps := map[string]bool{}, map[string]bool{}
	for _, v := range vms {
		keepVMs[v.ID] = true
		f.publishVMRow(v)
		exps, err := f.st.ListExposures(ctx, v.ID)
		if err != nil {
			return err
		}
		for _, e := range exps {
			keepExps[e.ID] = true
			f.publishExposure(ctx, e.ID)
		}
	}
	for _, p := range f.published.exposuresNotIn(keepExps) {
		f.exposureRemoved(p.e, p.owner)
	}
	for _, v := range f.published.vmsNotIn(keepVMs) {
		f.vmRemoved(v.ID, v.OwnerID)
	}
	hosts, err := f.st.ListHosts(ctx)
	if err != nil {
		return err
	}
	present := map[string]bool{}
	for _, h := range hosts {
		present[h.ID] = true
		fl.hosts[h.ID] = true
		f.publishHost(ctx, h.ID)
	}
	for id := range fl.hosts {
		if !present[id] {
			delete(fl.hosts, id)
			f.endHost(id)
			f.Hosts.Publish(watch.Event[*eitriv1.Host]{ID: id, Removed: true})
		}
	}
	return nil
}

// followLive mirrors what other replicas' hosts said into this replica's
// registry, and ends streams here that another replica has taken over.
func (fl *follower) followLive(ctx context.Context) {
	f := fl.f
	rows, err := f.st.LiveSince(ctx, fl.liveAfter)
	if err != nil {
		fl.warn(ctx, "follow the hosts' live state", err)
		return
	}
	for _, row := range rows {
		fl.liveAfter = row.Rev
		if row.Replica == f.st.Replica() {
			continue
		}
		f.mu.Lock()
		if s := f.sessions[row.HostID]; s != nil && s.claim != row.Conn {
			s.cancel(ErrReplaced)
		}
		f.mu.Unlock()
		if !row.Connected || row.Expired {
			fl.dropMirror(ctx, row.HostID)
			continue
		}
		fl.mirrorRow(ctx, row)
	}
}

// mirrorRow makes this replica's registry show a host whose stream another
// replica holds, as that replica last wrote it.
func (fl *follower) mirrorRow(ctx context.Context, row store.HostLive) {
	f := fl.f
	now := f.now()
	var rep *eitriv1.ActualStateReport
	if row.Report != nil {
		rep = &eitriv1.ActualStateReport{}
		if err := proto.Unmarshal(row.Report, rep); err != nil {
			f.log.Warn("another replica's host report does not decode", "host", row.HostID, "err", err)
			return
		}
	}
	r := &f.replicas
	r.mu.Lock()
	m, ok := r.mirrors[row.HostID]
	if !ok || m.remote != row.Conn {
		hello := &eitriv1.Hello{}
		if err := proto.Unmarshal(row.Hello, hello); err != nil {
			r.mu.Unlock()
			f.log.Warn("another replica's host hello does not decode", "host", row.HostID, "err", err)
			return
		}
		var d registry.Diff
		m.remote = row.Conn
		// The new stream and its report land together, so no request here
		// finds the host connected but without capacity in between.
		if rep != nil {
			m.local, d = f.reg.ConnectReporting(row.HostID, hello, rep, now)
		} else {
			m.local, d = f.reg.Connect(row.HostID, hello, now)
		}
		if r.mirrors == nil {
			r.mirrors = map[string]mirror{}
		}
		r.mirrors[row.HostID] = m
		r.mu.Unlock()
		f.publishDiff(ctx, row.HostID, d)
		if rep != nil {
			fl.takeUsage(ctx, row)
		}
		return
	}
	r.mu.Unlock()
	if rep == nil {
		return
	}
	if d, ok := f.reg.Apply(row.HostID, m.local, rep, now); ok {
		f.publishDiff(ctx, row.HostID, d)
	}
	fl.takeUsage(ctx, row)
}

// takeUsage adds the usage sample on a mirrored host's row to this
// replica's windows, once: the row is rewritten for every report.
func (fl *follower) takeUsage(ctx context.Context, row store.HostLive) {
	f := fl.f
	r := &f.replicas
	r.mu.Lock()
	seen := bytes.Equal(r.applied[row.HostID], row.Usage)
	if !seen && row.Usage != nil {
		if r.applied == nil {
			r.applied = map[string][]byte{}
		}
		r.applied[row.HostID] = row.Usage
	}
	r.mu.Unlock()
	if seen || row.Usage == nil {
		return
	}
	u := &eitriv1.UsageSample{}
	if err := proto.Unmarshal(row.Usage, u); err != nil {
		f.log.Warn("another replica's host usage does not decode", "host", row.HostID, "err", err)
		return
	}
	f.addUsage(ctx, row.HostID, u)
}

func (fl *follower) dropMirror(ctx context.Context, hostID string) {
	f := fl.f
	r := &f.replicas
	r.mu.Lock()
	m, ok := r.mirrors[hostID]
	delete(r.mirrors, hostID)
	delete(r.applied, hostID)
	r.mu.Unlock()
	if !ok {
		return
	}
	if d, ok := f.reg.Disconnect(hostID, m.local); ok {
		f.publishDiff(ctx, hostID, d)
	}
}

// heldElsewhere says whether another replica holds the host's stream (the
// host is mirrored here).
func (f *Fleet) heldElsewhere(hostID string) bool {
	f.replicas.mu.Lock()
	defer f.replicas.mu.Unlock()
	_, ok := f.replicas.mirrors[hostID]
	return ok
}
