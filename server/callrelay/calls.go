package callrelay

import (
	"context"
	"errors"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
)

const (
	// maxCallsPerHost bounds the calls one host serves at once, whoever
	// asked: the agent follows a log file for each console.
	maxCallsPerHost = 256
	// MaxHostCallsPerUser is one user's share of those (consoles, inputs
	// and tunnels together), so one user cannot take a host's every slot
	// and leave nobody else a console.
	MaxHostCallsPerUser = maxCallsPerHost / 4
	// callQueue is how many calls may wait for a host's Calls stream to
	// take them.
	callQueue = 64
	// AnswerWithin bounds the wait for the agent to answer a call.
	AnswerWithin = 15 * time.Second
)

// calls is the relay's state of the hosts' Calls streams and the calls
// made to them.
type calls struct {
	mu      sync.Mutex
	lines   map[string]*CallLine    // host id → its agent's Calls stream
	pending map[string]*pendingCall // call id → a call waiting or answered
	active  map[string]int          // host id → calls in flight
	byUser  map[userOnHost]int      // calls in flight, per user and host
	input   map[string]*inputBucket // user id → its typing allowance
	typing  map[string]bool         // vm id → an input call in flight
	// unanswered counts each host's calls sent and not answered yet, and
	// opening its answer streams not yet matched to a call: a host may
	// open no more of those than it has calls to answer.
	unanswered map[string]int
	opening    map[string]int
}

// userOnHost keys one user's calls to one host.
type userOnHost struct{ hostID, userID string }

// CallLine is one host's Calls stream.
type CallLine struct {
	r      *Relay
	hostID string
	calls  chan *eitriv1.CallsResponse
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// errCallsReplaced ends a Calls stream a newer one from the host replaced.
var errCallsReplaced = errors.New("replaced by a newer calls stream from the same host")

// OpenCalls registers a host's Calls stream, replacing an older one. A
// stream from another agent process than the one holding the host's Sync
// stream (a cloned disk) is refused, as Sync refuses it. Every agent that
// takes calls names its process, so a stream that names none is refused
// rather than let past that check.
func (r *Relay) OpenCalls(ctx context.Context, hostID, instance string) (*CallLine, error) {
	if instance == "" {
		return nil, invalid("instance_id", "required: the agent process's id, the one its Sync stream's hello carries")
	}
	if held, connected := r.cfg.Hosts.Instance(hostID); connected && held != "" && held != instance {
		return nil, errorf(Precondition, "another agent process holds this host's stream (a copy of its identity?); this one gets no calls")
	}
	lctx, cancel := context.WithCancelCause(ctx)
	l := &CallLine{r: r, hostID: hostID, calls: make(chan *eitriv1.CallsResponse, callQueue), ctx: lctx, cancel: cancel}
	h := &r.calls
	h.mu.Lock()
	if h.lines == nil {
		h.lines = map[string]*CallLine{}
	}
	if old := h.lines[hostID]; old != nil {
		old.cancel(errCallsReplaced)
	}
	h.lines[hostID] = l
	h.mu.Unlock()
	return l, nil
}

// Next is the next call to send the agent; it fails once the line is
// replaced or ctx ends.
func (l *CallLine) Next(ctx context.Context) (*eitriv1.CallsResponse, error) {
	select {
	case c := <-l.calls:
		return c, nil
	case <-l.ctx.Done():
		return nil, context.Cause(l.ctx)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Close forgets the line unless a newer one replaced it.
func (l *CallLine) Close() {
	h := &l.r.calls
	h.mu.Lock()
	if h.lines[l.hostID] == l {
		delete(h.lines, l.hostID)
	}
	h.mu.Unlock()
	l.cancel(context.Canceled)
}

// pendingCall is one call from its request until the requester leaves.
type pendingCall struct {
	hostID   string
	attached chan struct{} // closed when the agent's answer arrives
	frames   chan Frame    // the agent's frames, in order, then its hangup
	gone     chan struct{} // closed when the requester leaves
	once     sync.Once
	// tunnel is set for a tunnel call, which the agent answers on a Tunnel
	// stream (tunnel.go) rather than a Console stream.
	tunnel *tunnelPipes
}

// Frame is one message of an agent's answer on its Console stream, or
// (Msg nil) the stream's end, Err saying why.
type Frame struct {
	Msg *eitriv1.ConsoleRequest
	Err error
}

// Answer is a call its host's agent has taken up on a Console stream, from
// the caller's side.
type Answer struct {
	pc  *pendingCall
	end func()
}

// Call sends c to the host for caller and waits (up to AnswerWithin) for
// the agent to answer it on a Console stream. The call holds one of the
// host's and the caller's call slots until End.
func (r *Relay) Call(ctx context.Context, hostID string, caller auth.Principal, c *eitriv1.CallsResponse) (*Answer, error) {
	pc, end, err := r.call(ctx, hostID, caller, c, nil)
	if err != nil {
		return nil, err
	}
	return &Answer{pc: pc, end: end}, nil
}

// Frames delivers the agent's answer in order, then its hangup.
func (a *Answer) Frames() <-chan Frame { return a.pc.frames }

// End says the caller has left: the agent's stream ends, and the call's
// slots are given back.
func (a *Answer) End() { a.end() }

// call sends a call to the host for p and waits for the agent to answer
// it. The caller reads the answer's frames and must call end.
func (r *Relay) call(ctx context.Context, hostID string, p auth.Principal, c *eitriv1.CallsResponse, tunnel *tunnelPipes) (*pendingCall, func(), error) {
	h := &r.calls
	c.Id = newCallID()
	pc := &pendingCall{hostID: hostID, attached: make(chan struct{}), frames: make(chan Frame, 4), gone: make(chan struct{}), tunnel: tunnel}
	h.mu.Lock()
	line := h.lines[hostID]
	remote := false
	if line == nil {
		h.mu.Unlock()
		if _, connected := r.cfg.Hosts.Instance(hostID); connected {
			return nil, nil, errorf(Unavailable, "the vm's host does not relay consoles (its agent is older than this control plane, or reconnecting); try again shortly")
		}
		if !r.cfg.Hosts.HeldElsewhere(hostID) {
			return nil, nil, errorf(Unavailable, "the vm's host is not connected; its console comes back with it")
		}
		if r.cfg.AdvertiseURL == "" {
			return nil, nil, errorf(Unavailable, "the vm's host is connected to another control-plane replica, and this one has no --advertise-url for the host to answer at; try through another replica")
		}
		// Another replica holds the host's Calls stream: the call goes to
		// it through the database, and the agent answers here.
		remote = true
		c.AnswerUrl = r.cfg.AdvertiseURL
		h.mu.Lock()
	}
	if h.active[hostID] >= maxCallsPerHost {
		h.mu.Unlock()
		return nil, nil, errorf(Unavailable, "the vm's host serves %d consoles already; try again later", maxCallsPerHost)
	}
	mine := userOnHost{hostID, p.UserID}
	if n := h.byUser[mine]; n >= MaxHostCallsPerUser {
		h.mu.Unlock()
		return nil, nil, errorf(Exhausted, "%s has %d consoles, console inputs and tunnels open on this vm's host already, the most one user may on one host; close one", p.Name, n)
	}
	if h.pending == nil {
		h.pending, h.active, h.byUser, h.unanswered = map[string]*pendingCall{}, map[string]int{}, map[userOnHost]int{}, map[string]int{}
	}
	h.pending[c.Id] = pc
	h.active[hostID]++
	h.byUser[mine]++
	h.unanswered[hostID]++
	h.mu.Unlock()
	end := func() {
		select {
		case <-pc.attached: // answered: the holder took the call
		default:
			if remote {
				_ = r.cfg.Calls.DropCall(context.WithoutCancel(ctx), c.Id)
			}
		}
		pc.once.Do(func() { close(pc.gone) })
		h.mu.Lock()
		if h.pending[c.Id] == pc {
			delete(h.pending, c.Id)
			if h.active[hostID]--; h.active[hostID] <= 0 {
				delete(h.active, hostID)
			}
			if h.byUser[mine]--; h.byUser[mine] <= 0 {
				delete(h.byUser, mine)
			}
			select {
			case <-pc.attached:
			default:
				h.answered(hostID)
			}
		}
		h.mu.Unlock()
	}
	var lineGone <-chan struct{} // nil for a remote host: the wait is bounded below
	if remote {
		if err := r.postCall(ctx, hostID, c); err != nil {
			end()
			return nil, nil, err
		}
	} else {
		lineGone = line.ctx.Done()
		select {
		case line.calls <- c:
		default:
			end()
			return nil, nil, errorf(Unavailable, "the vm's host is not taking console calls fast enough; try again shortly")
		}
	}
	t := time.NewTimer(AnswerWithin)
	defer t.Stop()
	select {
	case <-pc.attached:
		return pc, end, nil
	case <-ctx.Done():
		end()
		return nil, nil, ctx.Err()
	case <-lineGone:
		end()
		return nil, nil, errorf(Unavailable, "the vm's host went away before it answered; try again")
	case <-t.C:
		end()
		return nil, nil, errorf(Unavailable, "the vm's host did not answer within %s", AnswerWithin)
	}
}

// attach marks the call hostID was sent as answered, on a Tunnel stream
// (tunnel) or a Console stream. A host answers only its own calls, once
// each.
func (h *calls) attach(hostID, callID string, tunnel bool) (*pendingCall, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	pc := h.pending[callID]
	if pc == nil || pc.hostID != hostID || (pc.tunnel != nil) != tunnel {
		return nil, errorf(NotFound, "no such call (it ended, was never made, or is answered on another stream)")
	}
	select {
	case <-pc.attached:
		return nil, errorf(Conflict, "call %s is answered already", callID)
	default:
	}
	close(pc.attached)
	h.answered(hostID)
	return pc, nil
}

// answered says one of hostID's calls no longer waits for an answer. The
// caller holds h.mu.
func (h *calls) answered(hostID string) {
	if h.unanswered[hostID]--; h.unanswered[hostID] <= 0 {
		delete(h.unanswered, hostID)
	}
}

// OpenAnswer admits one of a host's answer streams (Console or Tunnel)
// before a byte of it is read: a host answers only the calls it was sent,
// so it may have no more streams naming their call at once than it has
// calls waiting for an answer. done is called once the stream has named
// its call, or failed to.
func (r *Relay) OpenAnswer(hostID string) (done func(), err error) {
	h := &r.calls
	h.mu.Lock()
	defer h.mu.Unlock()
	waiting, opening := h.unanswered[hostID], h.opening[hostID]
	if waiting == 0 {
		return nil, errorf(NotFound, "no call of this host's is waiting for an answer (it ended, or was never made)")
	}
	if opening >= waiting {
		return nil, errorf(Exhausted, "answer streams: this host has %d calls waiting for an answer and %d streams opening to answer them already, "+
			"no more than one stream per call", waiting, opening)
	}
	if h.opening == nil {
		h.opening = map[string]int{}
	}
	h.opening[hostID]++
	var once sync.Once
	return func() {
		once.Do(func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			if h.opening[hostID]--; h.opening[hostID] <= 0 {
				delete(h.opening, hostID)
			}
		})
	}, nil
}

// postCall hands a call to the replica holding its host.
func (r *Relay) postCall(ctx context.Context, hostID string, c *eitriv1.CallsResponse) error {
	b, err := proto.Marshal(c)
	if err != nil {
		return err
	}
	if err := r.cfg.Calls.PostCall(ctx, store.PostedCall{ID: c.Id, HostID: hostID, Call: b}); err != nil {
		r.cfg.Log.Warn("post a call to the host's replica", "host", hostID, "err", err)
		return errorf(Unavailable, "the vm's host is connected to another control-plane replica, which this one cannot reach now; try again")
	}
	return nil
}

// TakeCalls sends the calls other replicas posted for hosts whose Calls
// stream is here down those streams.
func (r *Relay) TakeCalls(ctx context.Context) {
	h := &r.calls
	h.mu.Lock()
	hosts := make([]string, 0, len(h.lines))
	for id := range h.lines {
		hosts = append(hosts, id)
	}
	h.mu.Unlock()
	posted, err := r.cfg.Calls.TakeCalls(ctx, hosts)
	if err != nil {
		if ctx.Err() == nil {
			r.cfg.Log.Warn("take the calls other replicas posted", "err", err)
		}
		return
	}
	for _, pc := range posted {
		c := &eitriv1.CallsResponse{}
		if err := proto.Unmarshal(pc.Call, c); err != nil {
			r.cfg.Log.Warn("a posted call does not decode", "call", pc.ID, "err", err)
			continue
		}
		h.mu.Lock()
		line := h.lines[pc.HostID]
		h.mu.Unlock()
		if line == nil {
			continue // the stream went meanwhile; the caller times out
		}
		select {
		case line.calls <- c:
		default:
			r.cfg.Log.Warn("the host is not taking calls fast enough; one from another replica is dropped", "host", pc.HostID, "call", pc.ID)
		}
	}
}
