// Package api is the Connect surface of the control plane. Handlers are
// thin: decode, call the fleet (which validates and authorizes), map errors
// to Connect codes.
package api

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/go-chi/chi/v5"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/vmstate"
)

// Mount registers every service on r, each under its /package.Service/
// prefix. obs is told of every call.
func Mount(r chi.Router, f *fleet.Fleet, obs Observer, log *slog.Logger) {
	opts := []connect.HandlerOption{
		connect.WithCodec(protoCodec{}),
		connect.WithCodec(jsonCodec{name: "json"}),
		connect.WithCodec(jsonCodec{name: "json; charset=utf-8"}),
		// Every message is bounded, compressed and inflated (limits.go).
		connect.WithConditionalHandlerOptions(messageLimits),
		// First, so it sees what every later interceptor refuses.
		connect.WithInterceptors(observing{obs}),
		connect.WithInterceptors(auth.Interceptor{
			Resolve: f.Resolve, ResolveSession: f.ResolveSession, Hold: f.Hold,
			Skip: func(procedure string) bool {
				return strings.HasPrefix(procedure, "/"+eitriv1connect.AgentServiceName+"/")
			},
		}),
	}
	h := handlers{f: f, log: log, obs: obs}
	// After auth, so the principal whose streams are counted is known.
	opts = append(opts, connect.WithInterceptors(streamQuota{h}))
	// After auth too: a caller who may not call learns nothing from it.
	opts = append(opts, connect.WithInterceptors(plainText{}))
	for _, mount := range []func() (string, http.Handler){
		func() (string, http.Handler) { return eitriv1connect.NewVMServiceHandler(vmService{h}, opts...) },
		func() (string, http.Handler) {
			return eitriv1connect.NewExposureServiceHandler(exposureService{h}, opts...)
		},
		func() (string, http.Handler) { return eitriv1connect.NewHostServiceHandler(hostService{h}, opts...) },
		func() (string, http.Handler) { return eitriv1connect.NewTokenServiceHandler(tokenService{h}, opts...) },
		func() (string, http.Handler) { return eitriv1connect.NewQuotaServiceHandler(quotaService{h}, opts...) },
		func() (string, http.Handler) { return eitriv1connect.NewAgentServiceHandler(agentService{h}, opts...) },
		func() (string, http.Handler) { return eitriv1connect.NewSSHServiceHandler(sshService{h}, opts...) },
		func() (string, http.Handler) {
			return eitriv1connect.NewReleaseServiceHandler(releaseService{h}, opts...)
		},
		func() (string, http.Handler) { return eitriv1connect.NewUsageServiceHandler(usageService{h}, opts...) },
		func() (string, http.Handler) { return eitriv1connect.NewImageServiceHandler(imageService{h}, opts...) },
	} {
		path, handler := mount()
		// auth.Console: the console's cookie is good here (from its own pages).
		r.Handle(path+"*", observeUnrouted(obs, withFlushGate(auth.Console(handler))))
	}
}

type handlers struct {
	f   *fleet.Fleet
	log *slog.Logger
	obs Observer
}

// toConnect maps a fleet error to its Connect code. Internal errors are
// logged and not echoed, so no SQL text reaches a caller.
func (h handlers) toConnect(err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return connect.NewError(connect.CodeCanceled, err)
	}
	if k := fleet.KindOf(err); k != fleet.Internal {
		return connect.NewError(k.Code(), err)
	}
	h.log.Error("internal error", "err", err)
	return connect.NewError(connect.CodeInternal, errors.New("internal error (see the control plane's log)"))
}

func reply[T any](h handlers, msg *T, err error) (*connect.Response[T], error) {
	if err != nil {
		return nil, h.toConnect(err)
	}
	return connect.NewResponse(msg), nil
}

// ErrShuttingDown is the cause a control plane cancels its requests with
// when it stops (server.Serve does): a stream it ends says Unavailable, so
// a client that reconnects on errors comes back once the control plane is
// up again, while a clean end would read as "nothing more, ever".
var ErrShuttingDown = errors.New("the control plane is shutting down; reconnect")

// shutdownErr is the stream's final status when ctx ended because the
// control plane is stopping, and nil otherwise (the client went away).
func shutdownErr(ctx context.Context) error {
	if errors.Is(context.Cause(ctx), ErrShuttingDown) {
		return connect.NewError(connect.CodeUnavailable, ErrShuttingDown)
	}
	return nil
}

// stream sends the starting list, then every change, until the client goes
// or the control plane stops. A change after a quiet spell leaves at once;
// a busy stream writes at most once per watchPace, everything new in one
// batch.
func stream[T any, R any](ctx context.Context, h handlers, w *watch.Watcher[T], first *R, out serverStream[R], wrap func(watch.Event[T]) *R) error {
	defer w.Close()
	gate := gateOf(ctx)
	if err := gate.batch(func() error { return out.Send(first) }); err != nil {
		return err
	}
	raw := rawFraming(gate, out.Conn())
	var last time.Time // when the last batch started
	pause := time.NewTimer(0)
	defer pause.Stop()
	settle := func(ctx context.Context) error {
		wait := watchPace - time.Since(last)
		if wait <= 0 {
			return nil
		}
		pause.Reset(wait)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-pause.C:
			return nil
		}
	}
	var frames []byte
	for {
		evs, err := w.NextSettled(ctx, settle)
		if err != nil {
			return shutdownErr(ctx)
		}
		last = time.Now()
		// Whatever piled up while the last batch was written goes out
		// with one flush.
		err = gate.batch(func() error {
			frames = frames[:0]
			for _, ev := range evs {
				// Every watcher of this change sends the same message, built
				// and encoded once per codec (outgoing).
				o := ev.Memo.Do(func() any { return &outgoing{msg: wrap(ev), enc: &encodings{}} }).(*outgoing)
				msg := o.msg.(*R)
				if raw != nil {
					var ok bool
					if frames, ok = raw.append(frames, o); ok {
						continue
					}
					if err := raw.write(frames); err != nil {
						return err
					}
					frames = frames[:0]
				}
				share(msg, o.enc) // only a stream Connect frames needs the lookup
				if err := out.Send(msg); err != nil {
					return err
				}
			}
			if raw != nil {
				return raw.write(frames)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
}

// serverStream is what stream needs of a connect.ServerStream.
type serverStream[R any] interface {
	Send(*R) error
	Conn() connect.StreamingHandlerConn
}

// watchPace is the shortest interval between two writes of one Watch
// stream. Each write costs both ends a wakeup, a frame, a TLS record and a
// system call whatever it carries; at a fleet's rate of change (a hundred
// a second to every console) writing each change alone spent the machine
// on those, and changes queued behind them for seconds. Paced, a change
// waits at most this long for the ones after it.
var watchPace = 20 * time.Millisecond

type vmService struct{ handlers }

func (s vmService) CreateVM(ctx context.Context, r *connect.Request[eitriv1.CreateVMRequest]) (*connect.Response[eitriv1.CreateVMResponse], error) {
	vm, err := s.f.CreateVM(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.CreateVMResponse{Vm: vm}, err)
}

func (s vmService) GetVM(ctx context.Context, r *connect.Request[eitriv1.GetVMRequest]) (*connect.Response[eitriv1.GetVMResponse], error) {
	vm, err := s.f.GetVM(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.GetVMResponse{Vm: vm}, err)
}

func (s vmService) ListVMs(ctx context.Context, _ *connect.Request[eitriv1.ListVMsRequest]) (*connect.Response[eitriv1.ListVMsResponse], error) {
	vms, err := s.f.ListVMs(ctx)
	return reply(s.handlers, &eitriv1.ListVMsResponse{Vms: vms}, err)
}

func (s vmService) StartVM(ctx context.Context, r *connect.Request[eitriv1.StartVMRequest]) (*connect.Response[eitriv1.StartVMResponse], error) {
	vm, err := s.f.SetPower(ctx, r.Msg.GetId(), vmstate.PowerRunning)
	return reply(s.handlers, &eitriv1.StartVMResponse{Vm: vm}, err)
}

func (s vmService) StopVM(ctx context.Context, r *connect.Request[eitriv1.StopVMRequest]) (*connect.Response[eitriv1.StopVMResponse], error) {
	vm, err := s.f.SetPower(ctx, r.Msg.GetId(), vmstate.PowerStopped)
	return reply(s.handlers, &eitriv1.StopVMResponse{Vm: vm}, err)
}

func (s vmService) DeleteVM(ctx context.Context, r *connect.Request[eitriv1.DeleteVMRequest]) (*connect.Response[eitriv1.DeleteVMResponse], error) {
	vm, err := s.f.DeleteVM(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.DeleteVMResponse{Vm: vm}, err)
}

func (s vmService) RestoreVM(ctx context.Context, r *connect.Request[eitriv1.RestoreVMRequest]) (*connect.Response[eitriv1.RestoreVMResponse], error) {
	vm, err := s.f.RestoreVM(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.RestoreVMResponse{Vm: vm}, err)
}

func (s vmService) ListVMEvents(ctx context.Context, r *connect.Request[eitriv1.ListVMEventsRequest]) (*connect.Response[eitriv1.ListVMEventsResponse], error) {
	out, err := s.f.ListVMEvents(ctx, r.Msg)
	return reply(s.handlers, out, err)
}

func (s vmService) WatchVMs(ctx context.Context, r *connect.Request[eitriv1.WatchVMsRequest], out *connect.ServerStream[eitriv1.WatchVMsResponse]) error {
	w, list, err := s.f.WatchVMs(ctx, r.Msg.GetVmId())
	if err != nil {
		return s.toConnect(err)
	}
	first := &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_Snapshot{Snapshot: &eitriv1.VMList{Vms: list}}}
	return stream(ctx, s.handlers, w, first, out, func(ev watch.Event[*eitriv1.VM]) *eitriv1.WatchVMsResponse {
		if ev.Removed {
			return &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_RemovedId{RemovedId: ev.ID}}
		}
		return &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_Changed{Changed: ev.Obj}}
	})
}

type exposureService struct{ handlers }

func (s exposureService) CreateExposure(ctx context.Context, r *connect.Request[eitriv1.CreateExposureRequest]) (*connect.Response[eitriv1.CreateExposureResponse], error) {
	e, err := s.f.CreateExposure(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.CreateExposureResponse{Exposure: e}, err)
}

func (s exposureService) ListExposures(ctx context.Context, r *connect.Request[eitriv1.ListExposuresRequest]) (*connect.Response[eitriv1.ListExposuresResponse], error) {
	list, err := s.f.ListExposures(ctx, r.Msg.GetVmId())
	return reply(s.handlers, &eitriv1.ListExposuresResponse{Exposures: list}, err)
}

func (s exposureService) DeleteExposure(ctx context.Context, r *connect.Request[eitriv1.DeleteExposureRequest]) (*connect.Response[eitriv1.DeleteExposureResponse], error) {
	err := s.f.DeleteExposure(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.DeleteExposureResponse{}, err)
}

func (s exposureService) WatchExposures(ctx context.Context, r *connect.Request[eitriv1.WatchExposuresRequest], out *connect.ServerStream[eitriv1.WatchExposuresResponse]) error {
	w, list, err := s.f.WatchExposures(ctx, r.Msg.GetVmId())
	if err != nil {
		return s.toConnect(err)
	}
	first := &eitriv1.WatchExposuresResponse{Event: &eitriv1.WatchExposuresResponse_Snapshot{Snapshot: &eitriv1.ExposureList{Exposures: list}}}
	return stream(ctx, s.handlers, w, first, out, func(ev watch.Event[*eitriv1.Exposure]) *eitriv1.WatchExposuresResponse {
		if ev.Removed {
			return &eitriv1.WatchExposuresResponse{Event: &eitriv1.WatchExposuresResponse_RemovedId{RemovedId: ev.ID}}
		}
		return &eitriv1.WatchExposuresResponse{Event: &eitriv1.WatchExposuresResponse_Changed{Changed: ev.Obj}}
	})
}

type hostService struct{ handlers }

func (s hostService) ListHosts(ctx context.Context, _ *connect.Request[eitriv1.ListHostsRequest]) (*connect.Response[eitriv1.ListHostsResponse], error) {
	hosts, err := s.f.ListHosts(ctx)
	return reply(s.handlers, &eitriv1.ListHostsResponse{Hosts: hosts}, err)
}

func (s hostService) GetHost(ctx context.Context, r *connect.Request[eitriv1.GetHostRequest]) (*connect.Response[eitriv1.GetHostResponse], error) {
	h, err := s.f.GetHost(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.GetHostResponse{Host: h}, err)
}

func (s hostService) CreateJoinToken(ctx context.Context, r *connect.Request[eitriv1.CreateJoinTokenRequest]) (*connect.Response[eitriv1.CreateJoinTokenResponse], error) {
	if d := r.Msg.GetTtl(); d != nil {
		if err := d.CheckValid(); err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("ttl: "+err.Error()))
		}
	}
	resp, err := s.f.CreateJoinToken(ctx, r.Msg.GetTtl().AsDuration())
	return reply(s.handlers, resp, err)
}

func (s hostService) DecommissionHost(ctx context.Context, r *connect.Request[eitriv1.DecommissionHostRequest]) (*connect.Response[eitriv1.DecommissionHostResponse], error) {
	if r.Msg.GetForce() {
		resp, err := s.f.ForceDecommissionHost(ctx, r.Msg.GetId())
		return reply(s.handlers, resp, err)
	}
	err := s.f.DecommissionHost(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.DecommissionHostResponse{}, err)
}

func (s hostService) WatchHosts(ctx context.Context, _ *connect.Request[eitriv1.WatchHostsRequest], out *connect.ServerStream[eitriv1.WatchHostsResponse]) error {
	w, list, err := s.f.WatchHosts(ctx)
	if err != nil {
		return s.toConnect(err)
	}
	first := &eitriv1.WatchHostsResponse{Event: &eitriv1.WatchHostsResponse_Snapshot{Snapshot: &eitriv1.HostList{Hosts: list}}}
	return stream(ctx, s.handlers, w, first, out, func(ev watch.Event[*eitriv1.Host]) *eitriv1.WatchHostsResponse {
		if ev.Removed {
			return &eitriv1.WatchHostsResponse{Event: &eitriv1.WatchHostsResponse_RemovedId{RemovedId: ev.ID}}
		}
		return &eitriv1.WatchHostsResponse{Event: &eitriv1.WatchHostsResponse_Changed{Changed: ev.Obj}}
	})
}

type tokenService struct{ handlers }

func (s tokenService) CreateToken(ctx context.Context, r *connect.Request[eitriv1.CreateTokenRequest]) (*connect.Response[eitriv1.CreateTokenResponse], error) {
	if d := r.Msg.GetTtl(); d != nil {
		if err := d.CheckValid(); err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("ttl: "+err.Error()))
		}
	}
	tok, secret, err := s.f.CreateToken(ctx, r.Msg.GetName(), r.Msg.GetTtl().AsDuration(), r.Msg.GetUserName())
	return reply(s.handlers, &eitriv1.CreateTokenResponse{Token: tok, Secret: secret}, err)
}

func (s tokenService) ListTokens(ctx context.Context, _ *connect.Request[eitriv1.ListTokensRequest]) (*connect.Response[eitriv1.ListTokensResponse], error) {
	toks, err := s.f.ListTokens(ctx)
	return reply(s.handlers, &eitriv1.ListTokensResponse{Tokens: toks}, err)
}

func (s tokenService) RevokeToken(ctx context.Context, r *connect.Request[eitriv1.RevokeTokenRequest]) (*connect.Response[eitriv1.RevokeTokenResponse], error) {
	err := s.f.RevokeToken(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.RevokeTokenResponse{}, err)
}

func (s tokenService) ListSessions(ctx context.Context, _ *connect.Request[eitriv1.ListSessionsRequest]) (*connect.Response[eitriv1.ListSessionsResponse], error) {
	list, err := s.f.ListSessions(ctx)
	return reply(s.handlers, &eitriv1.ListSessionsResponse{Sessions: list}, err)
}

func (s tokenService) RevokeSession(ctx context.Context, r *connect.Request[eitriv1.RevokeSessionRequest]) (*connect.Response[eitriv1.RevokeSessionResponse], error) {
	err := s.f.RevokeSession(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.RevokeSessionResponse{}, err)
}
