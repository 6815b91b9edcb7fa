package callrelay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/wire/bounds"
)

// A tunnel carries one TCP connection between a user and a port of a VM's
// guest, relayed like the console: the tunnel is a call sent down the
// host's Calls stream, which the agent answers on a Tunnel stream of its
// own after dialing the guest on its bridge. The user's stream
// (OpenTunnel) and the agent's (AnswerTunnel) meet in tunnelPipes.
//
// Memory is bounded by flow control, not by buffers here: each direction
// passes one frame (at most MaxTunnelChunk) at a time through an
// unbuffered channel, so a side that stops reading stops the other side's
// reads, and HTTP/2's per-stream windows push back to the sender and, on
// the host, to the guest's TCP window.

const (
	// MaxTunnelChunk bounds the data in one tunnel message, either way.
	MaxTunnelChunk = 32 << 10
	// DefaultMaxTunnelsPerUser is Config.MaxTunnelsPerUser's default.
	DefaultMaxTunnelsPerUser = 32
	// connectWithin bounds the wait for the agent to reach the guest once
	// it has answered the call (it dials with a shorter timeout).
	connectWithin = 20 * time.Second
)

// tunnelPipes joins the user's stream to the agent's.
type tunnelPipes struct {
	up   chan *eitriv1.TunnelResponse // user → guest: data, then eof
	down chan tunnelFrame             // guest → user, in order, then the agent's hangup
}

// tunnelFrame is one frame of the agent's answer, or (m nil) its end.
type tunnelFrame struct {
	m   *eitriv1.TunnelRequest
	err error
}

// tunnelCount is the open tunnels per user.
type tunnelCount struct {
	mu     sync.Mutex
	byUser map[string]int
}

// admit counts one more tunnel for the user, refusing past limit.
func (c *tunnelCount) admit(p auth.Principal, limit int) (release func(), err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.byUser == nil {
		c.byUser = map[string]int{}
	}
	if n := c.byUser[p.UserID]; n >= limit {
		return nil, errorf(Exhausted, "tunnels: %s has %d tunnels open already, the most one user may; close one", p.Name, n)
	}
	c.byUser[p.UserID]++
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			defer c.mu.Unlock()
			if c.byUser[p.UserID]--; c.byUser[p.UserID] <= 0 {
				delete(c.byUser, p.UserID)
			}
		})
	}, nil
}

// TunnelEnd is how one tunnel that reached its VM's host went.
type TunnelEnd struct {
	VMID   string
	Caller auth.Principal
	Port   uint32
	Opened time.Time
	// Up and Down are the bytes carried to the guest and from it.
	Up, Down int64
	// How says how the tunnel ended, in words.
	How string
	// Err is what the caller was told; nil for a tunnel that ended well.
	Err error
}

// OpenTunnel relays one tunnel for the caller: recv reads the caller's
// messages (the first names the VM and port; io.EOF is its half-close),
// send writes to it. It returns when both sides have closed (nil), the
// caller left (nil), or either side failed. A tunnel that reached its host
// is told to ended before its host's and user's slots are given back.
func (r *Relay) OpenTunnel(ctx context.Context, authorize Authorize, recv func() (*eitriv1.OpenTunnelRequest, error), send func(*eitriv1.OpenTunnelResponse) error, ended func(TunnelEnd)) error {
	first, err := recv()
	if errors.Is(err, io.EOF) {
		return invalid("vm_id", "required: the first message names the vm and the port")
	}
	if err != nil {
		return err
	}
	port := first.GetPort()
	if port == 0 || port > bounds.MaxPort {
		return invalid("port", "must be 1 to %d, got %d", bounds.MaxPort, port)
	}
	if n := len(first.GetData()); n > MaxTunnelChunk {
		return invalid("data", "%d bytes is more than %d in one message", n, MaxTunnelChunk)
	}
	vmID := first.GetVmId()
	to, err := authorize(ctx, vmID)
	if err != nil {
		return err
	}
	release, err := r.tunnels.admit(to.Caller, r.cfg.MaxTunnelsPerUser)
	if err != nil {
		return err
	}
	defer release()

	tp := &tunnelPipes{up: make(chan *eitriv1.TunnelResponse), down: make(chan tunnelFrame)}
	pc, end, err := r.call(ctx, to.HostID, to.Caller, &eitriv1.CallsResponse{Call: &eitriv1.CallsResponse_Tunnel{Tunnel: &eitriv1.TunnelCall{
		VmId: vmID, Port: port,
	}}}, tp)
	if err != nil {
		return err
	}
	defer end()

	t := &tunnelRun{ctx: ctx, tp: tp, gone: pc.gone, opened: r.now()}
	err = t.relay(first, recv, send)
	ended(TunnelEnd{VMID: vmID, Caller: to.Caller, Port: port, Opened: t.opened, Up: t.up.Load(), Down: t.down.Load(), How: t.ended, Err: err})
	return err
}

// tunnelRun is one tunnel's relay, from the user's side.
type tunnelRun struct {
	ctx    context.Context
	tp     *tunnelPipes
	gone   <-chan struct{}
	opened time.Time
	// Bytes carried each way, and how the tunnel ended, for its TunnelEnd.
	up, down atomic.Int64
	ended    string
}

func (t *tunnelRun) relay(first *eitriv1.OpenTunnelRequest, recv func() (*eitriv1.OpenTunnelRequest, error), send func(*eitriv1.OpenTunnelResponse) error) error {
	ctx := t.ctx
	// The agent first says whether the guest took the connection.
	timer := time.NewTimer(connectWithin)
	defer timer.Stop()
	select {
	case fr := <-t.tp.down:
		if err := t.agentEnd(fr); err != nil {
			return err
		}
		if !fr.m.GetConnected() {
			t.ended = "the host answered out of order"
			return errorf(Unavailable, "the vm's host answered the tunnel out of order")
		}
	case <-timer.C:
		t.ended = "the host did not connect in time"
		return errorf(Unavailable, "the vm's host did not reach the guest within %s", connectWithin)
	case <-ctx.Done():
		t.ended = "the caller left before it opened"
		return nil
	}
	if err := send(&eitriv1.OpenTunnelResponse{}); err != nil {
		t.ended = "the caller left"
		return err
	}

	upDone := make(chan error, 1)
	go func() { upDone <- t.pumpUp(first.GetData(), recv) }()
	userEOF, guestEOF := false, false
	for !userEOF || !guestEOF {
		select {
		case err := <-upDone:
			if err != nil {
				if ctx.Err() != nil {
					t.ended = "the caller left"
					return nil
				}
				t.ended = "the caller's stream failed: " + err.Error()
				return err
			}
			userEOF = true
		case fr := <-t.tp.down:
			if err := t.agentEnd(fr); err != nil {
				return err
			}
			if d := fr.m.GetData(); len(d) > 0 {
				if err := send(&eitriv1.OpenTunnelResponse{Data: d}); err != nil {
					t.ended = "the caller left"
					return nil
				}
				t.down.Add(int64(len(d)))
			}
			if fr.m.GetEof() && !guestEOF {
				guestEOF = true
				if err := send(&eitriv1.OpenTunnelResponse{Eof: true}); err != nil {
					t.ended = "the caller left"
					return nil
				}
			}
		case <-ctx.Done():
			t.ended = "the caller left"
			return nil
		}
	}
	t.ended = "closed by both sides"
	return nil
}

// agentEnd turns the agent's hangup or error frame into the tunnel's end;
// nil for a frame that carries the tunnel on.
func (t *tunnelRun) agentEnd(fr tunnelFrame) error {
	if fr.m == nil {
		t.ended = "the host hung up"
		return errorf(Unavailable, "the vm's host ended the tunnel (%v)", fr.err)
	}
	if fr.m.GetErrorCode() != "" {
		msg := fr.m.GetError()
		if msg == "" {
			msg = "the host could not do it"
		}
		t.ended = "failed: " + msg
		switch fr.m.GetErrorCode() {
		case "not_found":
			return errorf(Precondition, "the vm's host holds no such vm (not created there yet?): %s", msg)
		case "failed_precondition":
			return errorf(Precondition, "%s", msg)
		default:
			return errorf(Unavailable, "the vm's host: %s", msg)
		}
	}
	return nil
}

// pumpUp carries the caller's bytes to the agent until the caller
// half-closes (nil, after passing on the eof) or fails.
func (t *tunnelRun) pumpUp(first []byte, recv func() (*eitriv1.OpenTunnelRequest, error)) error {
	push := func(m *eitriv1.TunnelResponse) error {
		select {
		case t.tp.up <- m:
			t.up.Add(int64(len(m.GetData())))
			return nil
		case <-t.gone:
			return context.Canceled
		case <-t.ctx.Done():
			return t.ctx.Err()
		}
	}
	if len(first) > 0 {
		if err := push(&eitriv1.TunnelResponse{Data: first}); err != nil {
			return err
		}
	}
	for {
		m, err := recv()
		if errors.Is(err, io.EOF) {
			return push(&eitriv1.TunnelResponse{Eof: true})
		}
		if err != nil {
			return err
		}
		if m.GetVmId() != "" || m.GetPort() != 0 {
			return invalid("vm_id", "only the first message names the vm and port")
		}
		if n := len(m.GetData()); n > MaxTunnelChunk {
			return invalid("data", "%d bytes is more than %d in one message", n, MaxTunnelChunk)
		}
		if len(m.GetData()) == 0 {
			continue
		}
		if err := push(&eitriv1.TunnelResponse{Data: m.GetData()}); err != nil {
			return err
		}
	}
}

// TunnelAnswer is an agent's Tunnel stream, matched to its call.
type TunnelAnswer struct {
	pc *pendingCall
}

// AnswerTunnel matches an agent's Tunnel stream to the tunnel call it
// names. A host answers only its own calls, once each.
func (r *Relay) AnswerTunnel(hostID, callID string) (*TunnelAnswer, error) {
	pc, err := r.calls.attach(hostID, callID, true)
	if err != nil {
		return nil, err
	}
	return &TunnelAnswer{pc: pc}, nil
}

// Relay carries the agent's side of the tunnel: recv reads the agent's
// frames (after the first, which named the call), send writes the user's
// bytes to it. It returns once the user's side has ended, or send fails.
func (a *TunnelAnswer) Relay(ctx context.Context, recv func() (*eitriv1.TunnelRequest, error), send func(*eitriv1.TunnelResponse) error) error {
	tp, gone := a.pc.tunnel, a.pc.gone
	deliver := func(fr tunnelFrame) bool {
		select {
		case tp.down <- fr:
			return true
		case <-gone:
			return false
		case <-ctx.Done():
			return false
		}
	}
	go func() {
		for {
			m, err := recv()
			if err != nil {
				deliver(tunnelFrame{err: err})
				return
			}
			if n := len(m.GetData()); n > MaxTunnelChunk {
				deliver(tunnelFrame{err: fmt.Errorf("the host sent %d bytes in one frame, more than %d", n, MaxTunnelChunk)})
				return
			}
			if len(m.GetData()) == 0 && !m.GetEof() && !m.GetConnected() && m.GetErrorCode() == "" {
				continue
			}
			if !deliver(tunnelFrame{m: m}) {
				return
			}
		}
	}()
	for {
		select {
		case m := <-tp.up:
			if err := send(m); err != nil {
				return err
			}
		case <-gone:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
