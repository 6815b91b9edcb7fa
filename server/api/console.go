package api

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
)

// StreamConsole relays the VM's serial output from its host.
func (s vmService) StreamConsole(ctx context.Context, r *connect.Request[eitriv1.StreamConsoleRequest], out *connect.ServerStream[eitriv1.StreamConsoleResponse]) error {
	err := s.f.StreamConsole(ctx, r.Msg, out.Send)
	if err == nil {
		return shutdownErr(ctx)
	}
	return s.toConnect(err)
}

// SendConsoleInput types into the VM's serial console through its host.
func (s vmService) SendConsoleInput(ctx context.Context, r *connect.Request[eitriv1.SendConsoleInputRequest]) (*connect.Response[eitriv1.SendConsoleInputResponse], error) {
	err := s.f.SendConsoleInput(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.SendConsoleInputResponse{}, err)
}

// hostOf is the host a host credential names.
func (s agentService) hostOf(ctx context.Context, h http.Header) (string, error) {
	cred := auth.Secret(h)
	if cred == "" {
		return "", connect.NewError(connect.CodeUnauthenticated, errors.New("missing host credential"))
	}
	id, err := s.f.HostByCredential(ctx, cred)
	if err != nil {
		return "", s.toConnect(err)
	}
	return id, nil
}

// Calls sends the host's agent the console calls made for its VMs.
func (s agentService) Calls(ctx context.Context, r *connect.Request[eitriv1.CallsRequest], out *connect.ServerStream[eitriv1.CallsResponse]) error {
	hostID, err := s.hostOf(ctx, r.Header())
	if err != nil {
		return err
	}
	line, err := s.f.Relay.OpenCalls(ctx, hostID, r.Msg.GetInstanceId())
	if err != nil {
		return s.toConnect(err)
	}
	defer line.Close()
	for {
		c, err := line.Next(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return shutdownErr(ctx)
			}
			return connect.NewError(connect.CodeAborted, err)
		}
		if err := out.Send(c); err != nil {
			return err
		}
	}
}

// Console carries the agent's answer to one call to whoever made it, and
// ends when they leave.
func (s agentService) Console(ctx context.Context, st *connect.BidiStream[eitriv1.ConsoleRequest, eitriv1.ConsoleResponse]) error {
	hostID, first, err := answerOpening(ctx, s, st.RequestHeader(), st.Receive, "Console")
	if err != nil {
		return err
	}
	a, err := s.f.Relay.AnswerConsole(hostID, first.GetCallId())
	if err != nil {
		return s.toConnect(err)
	}
	go func() {
		m := first
		for {
			if len(m.GetData()) > 0 || m.GetDone() || m.GetErrorCode() != "" || m.GetBoot() != "" || m != first {
				if !a.Deliver(ctx, m) {
					return
				}
			}
			var err error
			if m, err = st.Receive(); err != nil {
				a.Hangup(ctx, err)
				return
			}
		}
	}()
	select {
	case <-a.Done():
		return nil
	case <-ctx.Done():
		return shutdownErr(ctx)
	}
}

// OpenTunnel relays one TCP connection to a guest port through the VM's
// host.
func (s vmService) OpenTunnel(ctx context.Context, st *connect.BidiStream[eitriv1.OpenTunnelRequest, eitriv1.OpenTunnelResponse]) error {
	err := s.f.OpenTunnel(ctx, st.Receive, st.Send)
	if err == nil {
		return shutdownErr(ctx)
	}
	return s.toConnect(err)
}

// Tunnel carries the agent's side of one tunnel call, and ends when the
// tunnel does.
func (s agentService) Tunnel(ctx context.Context, st *connect.BidiStream[eitriv1.TunnelRequest, eitriv1.TunnelResponse]) error {
	hostID, first, err := answerOpening(ctx, s, st.RequestHeader(), st.Receive, "Tunnel")
	if err != nil {
		return err
	}
	a, err := s.f.Relay.AnswerTunnel(hostID, first.GetCallId())
	if err != nil {
		return s.toConnect(err)
	}
	if err := a.Relay(ctx, st.Receive, st.Send); err != nil && ctx.Err() == nil {
		return s.toConnect(err)
	}
	return shutdownErr(ctx)
}

// nameCallWithin bounds the wait for the first message of an answer
// stream: until it names its call, the stream holds one of its host's
// answer slots (callrelay.Relay.OpenAnswer).
const nameCallWithin = 15 * time.Second

// answerOpening reads what opens every stream an agent answers a call on:
// the host it comes from and a first message naming the call. The stream
// is refused unread unless its host has a call waiting for it.
func answerOpening[M interface{ GetCallId() string }](ctx context.Context, s agentService, h http.Header, receive func() (M, error), stream string) (string, M, error) {
	var none M
	hostID, err := s.hostOf(ctx, h)
	if err != nil {
		return "", none, err
	}
	done, err := s.f.Relay.OpenAnswer(hostID)
	if err != nil {
		return "", none, s.toConnect(err)
	}
	defer done()
	type received struct {
		m   M
		err error
	}
	got := make(chan received, 1)
	go func() {
		m, err := receive()
		got <- received{m, err}
	}()
	t := time.NewTimer(nameCallWithin)
	defer t.Stop()
	var first M
	select {
	case r := <-got:
		if r.err != nil {
			return "", none, r.err
		}
		first = r.m
	case <-t.C:
		// Returning closes the stream, which ends the receive.
		return "", none, connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("call_id: the first message on a %s stream names its call within %s", stream, nameCallWithin))
	case <-ctx.Done():
		if err := shutdownErr(ctx); err != nil {
			return "", none, err
		}
		return "", none, connect.NewError(connect.CodeCanceled, ctx.Err())
	}
	if first.GetCallId() == "" {
		return "", none, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("call_id: the first message on a %s stream names its call", stream))
	}
	return hostID, first, nil
}
