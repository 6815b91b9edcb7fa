package api

import (
	"context"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

type quotaService struct{ handlers }

func (s quotaService) GetQuota(ctx context.Context, r *connect.Request[eitriv1.GetQuotaRequest]) (*connect.Response[eitriv1.GetQuotaResponse], error) {
	q, err := s.f.GetQuota(ctx, r.Msg.GetUserName())
	return reply(s.handlers, &eitriv1.GetQuotaResponse{Quota: q}, err)
}

func (s quotaService) SetQuota(ctx context.Context, r *connect.Request[eitriv1.SetQuotaRequest]) (*connect.Response[eitriv1.SetQuotaResponse], error) {
	resp, err := s.f.SetQuota(ctx, r.Msg)
	return reply(s.handlers, resp, err)
}

// streamQuota counts every user's open streaming calls (watches, consoles, tunnels)
// against its quota, so one token cannot hold thousands of them. It runs
// inside the auth interceptor, which has put the principal in the context;
// calls without one (an agent's Sync) are not counted.
type streamQuota struct{ h handlers }

func (streamQuota) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc { return next }

func (streamQuota) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (q streamQuota) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		release, err := q.h.f.OpenStream(ctx)
		if err != nil {
			return q.h.toConnect(err)
		}
		defer release()
		return next(ctx, conn)
	}
}

var _ connect.Interceptor = streamQuota{}
