package fleet

import (
	"context"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// ConditionDuplicateAgent is the HostCondition type for a second agent
// with a host's identity.
const ConditionDuplicateAgent = "duplicate_agent"

// duplicateFor is how long a host shows the condition after the last
// refusal. A refused agent retries at least every 30 s (its longest
// backoff), so the condition lasts as long as it keeps trying and clears
// soon after it stops.
const duplicateFor = 75 * time.Second

// duplicate is a second agent that keeps knocking.
type duplicate struct {
	instance    string
	peer        string
	since, last time.Time
	expire      *time.Timer
}

// refuseDuplicate refuses hello when another agent process holds hostID's
// stream, and records the attempt for the host's conditions.
func (f *Fleet) refuseDuplicate(ctx context.Context, hostID string, hello *eitriv1.Hello, peer string, now time.Time) error {
	inst := hello.GetInstanceId()
	f.mu.Lock()
	cur := f.sessions[hostID]
	if cur == nil || cur.instance == "" || inst == "" || cur.instance == inst {
		// Admitted: if it was the refused one, it is the only agent now.
		if d := f.dups[hostID]; d != nil && d.instance == inst {
			d.expire.Stop()
			delete(f.dups, hostID)
		}
		f.mu.Unlock()
		return nil
	}
	curPeer, curSince := cur.peer, cur.since
	f.mu.Unlock()
	f.noteDuplicate(ctx, hostID, inst, peer, curPeer, now)
	return errorf(Precondition, "host %s already has an agent connected (from %s since %s); two agents share this host's identity. "+
		"If this machine is a copy of that host (a cloned disk), stop this agent, delete its data dir and enroll it with a new join token "+
		"(eitri host join-token). If that agent is gone, this one is let in once its connection times out (within 30 s).",
		hostID, curPeer, curSince.UTC().Format(time.RFC3339))
}

// noteDuplicate records a refused second agent for the host's conditions.
func (f *Fleet) noteDuplicate(ctx context.Context, hostID, inst, peer, curPeer string, now time.Time) {
	f.mu.Lock()
	d := f.dups[hostID]
	fresh := d == nil || now.Sub(d.last) > duplicateFor
	if fresh {
		if d != nil {
			d.expire.Stop()
		}
		d = &duplicate{since: now}
		d.expire = time.AfterFunc(duplicateFor, func() { f.publishHost(context.WithoutCancel(ctx), hostID) })
		f.dups[hostID] = d
	} else {
		d.expire.Reset(duplicateFor)
	}
	d.instance, d.peer, d.last = inst, peer, now
	f.mu.Unlock()

	if fresh {
		f.log.Warn("refused a second agent with this host's identity", "host", hostID, "peer", peer, "connected_peer", curPeer)
		f.publishHost(ctx, hostID)
	}
}

// conditions lists what is wrong with hostID right now.
func (f *Fleet) conditions(hostID string) []*eitriv1.HostCondition {
	return append(f.duplicateConditions(hostID), f.fencingConditions(hostID)...)
}

func (f *Fleet) duplicateConditions(hostID string) []*eitriv1.HostCondition {
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.dups[hostID]
	if d == nil || f.now().Sub(d.last) >= duplicateFor {
		return nil
	}
	return []*eitriv1.HostCondition{{
		Type: ConditionDuplicateAgent,
		Message: "a second agent with this host's identity keeps connecting from " + d.peer +
			" and is refused; stop it, or re-enroll that machine with a new join token",
		Since:      timestamppb.New(d.since),
		LastSeenAt: timestamppb.New(d.last),
	}}
}
