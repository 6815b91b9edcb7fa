package api

import (
	"context"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/watch"
)

type usageService struct{ handlers }

func (s usageService) WatchUsage(ctx context.Context, r *connect.Request[eitriv1.WatchUsageRequest], out *connect.ServerStream[eitriv1.WatchUsageResponse]) error {
	w, win, err := s.f.WatchUsage(ctx, r.Msg.GetVmId(), r.Msg.GetHostId())
	if err != nil {
		return s.toConnect(err)
	}
	first := &eitriv1.WatchUsageResponse{Event: &eitriv1.WatchUsageResponse_Window{Window: win}}
	return stream(ctx, s.handlers, w, first, out, func(ev watch.Event[*eitriv1.WatchUsageResponse]) *eitriv1.WatchUsageResponse {
		return ev.Obj
	})
}
