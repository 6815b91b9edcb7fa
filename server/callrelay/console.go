package callrelay

import (
	"context"
	"time"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

const (
	// MaxConsoleInput bounds one SendConsoleInput batch.
	MaxConsoleInput = 4096
	// maxConsoleTail bounds StreamConsoleRequest.tail_bytes.
	maxConsoleTail = 1 << 20
	// maxBootLen bounds StreamConsoleRequest.boot (agents make ~30 bytes).
	maxBootLen = 128
	// MaxConsoleChunk bounds the serial output in one message of an
	// agent's Console stream (agents send at most 32 KiB at a time).
	MaxConsoleChunk = 32 << 10

	// Console input is bounded per user by a token bucket over bytes, each
	// call costing at least inputCallCost: a person types far slower, a
	// paste is a few KiB, and a guest's 115200-baud UART takes ~11 KiB/s.
	inputBurst    = 64 << 10
	inputPerSec   = 16 << 10
	inputCallCost = 64
)

// ConsoleAnswer is an agent's Console stream, matched to its call.
type ConsoleAnswer struct {
	pc *pendingCall
}

// AnswerConsole matches an agent's Console stream to the call it names. A
// host answers only its own calls, once each.
func (r *Relay) AnswerConsole(hostID, callID string) (*ConsoleAnswer, error) {
	pc, err := r.calls.attach(hostID, callID, false)
	if err != nil {
		return nil, err
	}
	return &ConsoleAnswer{pc: pc}, nil
}

// Deliver passes one frame to the requester; false once it has left.
func (a *ConsoleAnswer) Deliver(ctx context.Context, m *eitriv1.ConsoleRequest) bool {
	return a.send(ctx, Frame{Msg: m})
}

// Hangup says the agent's stream ended, after every frame delivered.
func (a *ConsoleAnswer) Hangup(ctx context.Context, err error) {
	a.send(ctx, Frame{Err: err})
}

func (a *ConsoleAnswer) send(ctx context.Context, fr Frame) bool {
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
// caller resumes from the last boot and offset it received). The request
// is checked before authorize is asked about its VM.
func (r *Relay) StreamConsole(ctx context.Context, authorize Authorize, req *eitriv1.StreamConsoleRequest, send func(*eitriv1.StreamConsoleResponse) error) error {
	if n := len(req.GetBoot()); n > maxBootLen {
		return invalid("boot", "at most %d bytes, got %d", maxBootLen, n)
	}
	if req.GetOffset() < 0 {
		return invalid("offset", "must not be negative")
	}
	if req.GetTailBytes() > maxConsoleTail {
		return invalid("tail_bytes", "at most %d", maxConsoleTail)
	}
	to, err := authorize(ctx, req.GetVmId())
	if err != nil {
		return err
	}
	pc, end, err := r.call(ctx, to.HostID, to.Caller, &eitriv1.CallsResponse{Call: &eitriv1.CallsResponse_ConsoleOutput{ConsoleOutput: &eitriv1.ConsoleOutputCall{
		VmId: req.GetVmId(), Boot: req.GetBoot(), Offset: req.GetOffset(), TailBytes: req.GetTailBytes(), NoFollow: req.GetNoFollow(),
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
			m := fr.Msg
			if m == nil {
				return errorf(Unavailable, "the vm's host stopped relaying its console (%v); resume from the last offset", fr.Err)
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
// (Exhausted, which clients take as "wait and send again"). Queueing it
// instead would hold a request per waiting caller behind a guest that may
// never read, and keystrokes sent at once have no order to keep anyway.
// The request is checked before authorize is asked about its VM.
func (r *Relay) SendConsoleInput(ctx context.Context, authorize Authorize, req *eitriv1.SendConsoleInputRequest) error {
	n := len(req.GetData())
	if n == 0 {
		return invalid("data", "required (1 to %d bytes)", MaxConsoleInput)
	}
	if n > MaxConsoleInput {
		return invalid("data", "%d bytes is more than %d; send a paste in several calls", n, MaxConsoleInput)
	}
	to, err := authorize(ctx, req.GetVmId())
	if err != nil {
		return err
	}
	done, err := r.calls.startTyping(req.GetVmId())
	if err != nil {
		return err
	}
	defer done()
	if err := r.calls.allowInput(to.Caller.UserID, n, r.now()); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, AnswerWithin)
	defer cancel()
	pc, end, err := r.call(ctx, to.HostID, to.Caller, &eitriv1.CallsResponse{Call: &eitriv1.CallsResponse_ConsoleInput{ConsoleInput: &eitriv1.ConsoleInputCall{
		VmId: req.GetVmId(), Data: req.GetData(),
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
			m := fr.Msg
			if m == nil {
				return errorf(Unavailable, "the vm's host hung up before it typed the input (%v)", fr.Err)
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
func (h *calls) startTyping(vmID string) (done func(), err error) {
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

func (h *calls) allowInput(userID string, n int, now time.Time) error {
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
