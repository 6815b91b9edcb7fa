package fleet

import (
	"context"
	"errors"
	"sync"
	"time"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
)

// The serial console is relayed by the VM's host: nothing dials a host.
// Each host's agent keeps a Calls stream open (a CallLine here); a console
// request becomes a call sent down it, and the agent answers the call on a
// Console stream of its own that carries the call's id first
// (AnswerConsole). The request and the agent's answer meet in a pending
// call.

const (
	// MaxConsoleInput bounds one SendConsoleInput batch.
	MaxConsoleInput = 4096
	// maxConsoleTail bounds StreamConsoleRequest.tail_bytes.
	maxConsoleTail = 1 << 20
	// maxBootLen bounds StreamConsoleRequest.boot (agents make ~30 bytes).
	maxBootLen = 128
	// maxCallsPerHost bounds the console calls one host serves at once,
	// whoever asked: the agent follows a log file for each.
	maxCallsPerHost = 256
	// MaxHostCallsPerUser is one user's share of those (consoles, inputs
	// and tunnels together), so one user cannot take a host's every slot
	// and leave nobody else a console.
	MaxHostCallsPerUser = maxCallsPerHost / 4
	// MaxConsoleChunk bounds the serial output in one message of an
	// agent's Console stream (agents send at most 32 KiB at a time).
	MaxConsoleChunk = 32 << 10
	// callQueue is how many calls may wait for a host's Calls stream to
	// take them.
	callQueue = 64
	// answerWithin bounds the wait for the agent to answer a call.
	answerWithin = 15 * time.Second

	// Console input is bounded per user by a token bucket over bytes, each
	// call costing at least inputCallCost: a person types far slower, a
	// paste is a few KiB, and a guest's 115200-baud UART takes ~11 KiB/s.
	inputBurst    = 64 << 10
	inputPerSec   = 16 << 10
	inputCallCost = 64
)

// consoleHub is the fleet's console relay state.
type consoleHub struct {
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
	f      *Fleet
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
func (f *Fleet) OpenCalls(ctx context.Context, hostID, instance string) (*CallLine, error) {
	if instance == "" {
		return nil, invalid("instance_id", "required: the agent process's id, the one its Sync stream's hello carries")
	}
	f.mu.Lock()
	s := f.sessions[hostID]
	f.mu.Unlock()
	if s != nil && s.instance != "" && s.instance != instance {
		return nil, errorf(Precondition, "another agent process holds this host's stream (a copy of its identity?); this one gets no calls")
	}
	lctx, cancel := context.WithCancelCause(ctx)
	l := &CallLine{f: f, hostID: hostID, calls: make(chan *eitriv1.CallsResponse, callQueue), ctx: lctx, cancel: cancel}
	h := &f.consoles
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
	h := &l.f.consoles
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
	frames   chan frame    // the agent's frames, in order, then its hangup
	gone     chan struct{} // closed when the requester leaves
	once     sync.Once
	// tunnel is set for a tunnel call, which the agent answers on a Tunnel
	// stream (tunnel.go) rather than a Console stream.
	tunnel *tunnelPipes
}

// call sends a call to the VM's host for p and waits for the agent to
// answer it. The caller reads the answer's frames and must call end.
func (f *Fleet) call(ctx context.Context, hostID string, p auth.Principal, c *eitriv1.CallsResponse, tunnel *tunnelPipes) (*pendingCall, func(), error) {
	h := &f.consoles
	c.Id = newID("call")
	pc := &pendingCall{hostID: hostID, attached: make(chan struct{}), frames: make(chan frame, 4), gone: make(chan struct{}), tunnel: tunnel}
	h.mu.Lock()
	line := h.lines[hostID]
	remote := false
	if line == nil {
		h.mu.Unlock()
		f.mu.Lock()
		connected := f.sessions[hostID] != nil
		f.mu.Unlock()
		if connected {
			return nil, nil, errorf(Unavailable, "the vm's host does not relay consoles (its agent is older than this control plane, or reconnecting); try again shortly")
		}
		if !f.heldElsewhere(hostID) {
			return nil, nil, errorf(Unavailable, "the vm's host is not connected; its console comes back with it")
		}
		if f.cfg.AdvertiseURL == "" {
			return nil, nil, errorf(Unavailable, "the vm's host is connected to another control-plane replica, and this one has no --advertise-url for the host to answer at; try through another replica")
		}
		// Another replica holds the host's Calls stream: the call goes to
		// it through the database, and the agent answers here.
		remote = true
		c.AnswerUrl = f.cfg.AdvertiseURL
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
				_ = f.st.DropCall(context.WithoutCancel(ctx), c.Id)
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
		if err := f.postCall(ctx, hostID, c); err != nil {
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
	t := time.NewTimer(answerWithin)
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
		return nil, nil, errorf(Unavailable, "the vm's host did not answer within %s", answerWithin)
	}
}

// ConsoleAnswer is an agent's Console stream, matched to its call.
type ConsoleAnswer struct {
	pc *pendingCall
}

// AnswerConsole matches an agent's Console stream to the call it names. A
// host answers only its own calls, once each.
func (f *Fleet) AnswerConsole(hostID, callID string) (*ConsoleAnswer, error) {
	h := &f.consoles
	h.mu.Lock()
	defer h.mu.Unlock()
	pc, err := h.attach(hostID, callID, false)
	if err != nil {
		return nil, err
	}
	return &ConsoleAnswer{pc: pc}, nil
}

// attach marks the call hostID was sent as answered, on a Tunnel stream
// (tunnel) or a Console stream. The caller holds h.mu.
func (h *consoleHub) attach(hostID, callID string, tunnel bool) (*pendingCall, error) {
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
func (h *consoleHub) answered(hostID string) {
	if h.unanswered[hostID]--; h.unanswered[hostID] <= 0 {
		delete(h.unanswered, hostID)
	}
}

// OpenAnswer admits one of a host's answer streams (Console or Tunnel)
// before a byte of it is read: a host answers only the calls it was sent,
// so it may have no more streams naming their call at once than it has
// calls waiting for an answer. done is called once the stream has named
// its call, or failed to.
func (f *Fleet) OpenAnswer(hostID string) (done func(), err error) {
	h := &f.consoles
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

// frame is one message of an agent's answer, or (m nil) its end.
type frame struct {
	m   *eitriv1.ConsoleRequest
	err error
}

// Deliver passes one frame to the requester; false once it has left.
func (a *ConsoleAnswer) Deliver(ctx context.Context, m *eitriv1.ConsoleRequest) bool {
	return a.send(ctx, frame{m: m})
}

// Hangup says the agent's stream ended, after every frame delivered.
func (a *ConsoleAnswer) Hangup(ctx context.Context, err error) {
	a.send(ctx, frame{err: err})
}

func (a *ConsoleAnswer) send(ctx context.Context, fr frame) bool {
	select {
	case a.pc.frames <- fr:
		return true
	case <-a.pc.gone:
		return false
	case <-ctx.Done():
		return false
	}
}

// Done is closed once the requester has left.
func (a *ConsoleAnswer) Done() <-chan struct{} { return a.pc.gone }

// consoleVM is the VM a console request is for, with its host.
func (f *Fleet) consoleVM(ctx context.Context, id string) (string, auth.Principal, error) {
	vm, p, err := f.visible(ctx, id)
	if err != nil {
		return "", p, err
	}
	if vm.HostID == "" {
		return "", p, errorf(Precondition, "vm %s is on no host (%s); it has no console", id, vm.Status)
	}
	return vm.HostID, p, nil
}

// agentError is the error an agent's failed answer stands for.
func agentError(m *eitriv1.ConsoleRequest) error {
	msg := m.GetError()
	if msg == "" {
		msg = "the host could not do it"
	}
	switch m.GetErrorCode() {
	case "not_found":
		return errorf(Precondition, "the vm's host holds no such vm (not created there yet?): %s", msg)
	case "failed_precondition":
		return errorf(Precondition, "%s", msg)
	default:
		return errorf(Unavailable, "the vm's host: %s", msg)
	}
}

// StreamConsole sends the VM's serial output through send until ctx ends,
// the caller's send fails, or the host's relay ends (Unavailable: the
// caller resumes from the last boot and offset it received).
func (f *Fleet) StreamConsole(ctx context.Context, r *eitriv1.StreamConsoleRequest, send func(*eitriv1.StreamConsoleResponse) error) error {
	if err := checkLen("boot", r.GetBoot(), maxBootLen); err != nil {
		return err
	}
	if r.GetOffset() < 0 {
		return invalid("offset", "must not be negative")
	}
	if r.GetTailBytes() > maxConsoleTail {
		return invalid("tail_bytes", "at most %d", maxConsoleTail)
	}
	hostID, p, err := f.consoleVM(ctx, r.GetVmId())
	if err != nil {
		return err
	}
	pc, end, err := f.call(ctx, hostID, p, &eitriv1.CallsResponse{Call: &eitriv1.CallsResponse_ConsoleOutput{ConsoleOutput: &eitriv1.ConsoleOutputCall{
		VmId: r.GetVmId(), Boot: r.GetBoot(), Offset: r.GetOffset(), TailBytes: r.GetTailBytes(), NoFollow: r.GetNoFollow(),
	}}}, nil)
	if err != nil {
		return err
	}
	defer end()
	for {
		select {
		case <-ctx.Done():
			return nil
		case fr := <-pc.frames:
			m := fr.m
			if m == nil {
				return errorf(Unavailable, "the vm's host stopped relaying its console (%v); resume from the last offset", fr.err)
			}
			if m.GetErrorCode() != "" {
				return agentError(m)
			}
			if m.GetDone() {
				return nil // no_follow: the output so far is sent
			}
			if err := send(&eitriv1.StreamConsoleResponse{Data: m.GetData(), Boot: m.GetBoot(), Offset: m.GetOffset(), NewBoot: m.GetNewBoot()}); err != nil {
				return err
			}
		}
	}
}

// SendConsoleInput types data into the VM's serial console, one call at a
// time per VM: a second call while one is out is refused at once
// (ResourceExhausted, which clients take as "wait and send again").
// Queueing it instead would hold a request per waiting caller behind a
// guest that may never read, and keystrokes sent at once have no order to
// keep anyway.
func (f *Fleet) SendConsoleInput(ctx context.Context, r *eitriv1.SendConsoleInputRequest) error {
	n := len(r.GetData())
	if n == 0 {
		return invalid("data", "required (1 to %d bytes)", MaxConsoleInput)
	}
	if n > MaxConsoleInput {
		return invalid("data", "%d bytes is more than %d; send a paste in several calls", n, MaxConsoleInput)
	}
	hostID, p, err := f.consoleVM(ctx, r.GetVmId())
	if err != nil {
		return err
	}
	done, err := f.consoles.startTyping(r.GetVmId())
	if err != nil {
		return err
	}
	defer done()
	if err := f.consoles.allowInput(p.UserID, n, f.now()); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, answerWithin)
	defer cancel()
	pc, end, err := f.call(ctx, hostID, p, &eitriv1.CallsResponse{Call: &eitriv1.CallsResponse_ConsoleInput{ConsoleInput: &eitriv1.ConsoleInputCall{
		VmId: r.GetVmId(), Data: r.GetData(),
	}}}, nil)
	if err != nil {
		return err
	}
	defer end()
	for {
		select {
		case <-ctx.Done():
			return errorf(Unavailable, "the vm's host did not say whether it typed the input")
		case fr := <-pc.frames:
			m := fr.m
			if m == nil {
				return errorf(Unavailable, "the vm's host hung up before it typed the input (%v)", fr.err)
			}
			if m.GetErrorCode() != "" {
				return agentError(m)
			}
			if m.GetDone() {
				return nil
			}
		}
	}
}

// startTyping marks an input call to vmID in flight, refusing a second.
func (h *consoleHub) startTyping(vmID string) (done func(), err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.typing[vmID] {
		return nil, errorf(Exhausted, "console input: one call at a time per vm, and the last one to this vm has not been typed yet "+
			"(is its guest reading its console?); send again once it returns")
	}
	if h.typing == nil {
		h.typing = map[string]bool{}
	}
	h.typing[vmID] = true
	return func() {
		h.mu.Lock()
		delete(h.typing, vmID)
		h.mu.Unlock()
	}, nil
}

// inputBucket is one user's console typing allowance, in bytes.
type inputBucket struct {
	tokens float64
	last   time.Time
}

func (h *consoleHub) allowInput(userID string, n int, now time.Time) error {
	cost := float64(max(n, inputCallCost))
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.input == nil {
		h.input = map[string]*inputBucket{}
	}
	b := h.input[userID]
	if b == nil {
		b = &inputBucket{tokens: inputBurst, last: now}
		h.input[userID] = b
	}
	b.tokens = min(inputBurst, b.tokens+now.Sub(b.last).Seconds()*inputPerSec)
	b.last = now
	if b.tokens < cost {
		return errorf(Exhausted, "console input: more than %d KiB/s typed; slow down", inputPerSec>>10)
	}
	b.tokens -= cost
	// A bucket that has refilled is the same as none: forget those, so the
	// map holds only users typing now.
	if len(h.input) > 64 {
		for id, o := range h.input {
			if now.Sub(o.last).Seconds()*inputPerSec >= inputBurst {
				delete(h.input, id)
			}
		}
	}
	return nil
}
