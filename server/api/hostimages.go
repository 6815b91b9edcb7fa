package api

import (
	"context"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func (s hostService) ListHostImages(ctx context.Context, r *connect.Request[eitriv1.ListHostImagesRequest]) (*connect.Response[eitriv1.ListHostImagesResponse], error) {
	resp, err := s.f.ListHostImages(ctx, r.Msg.GetId())
	return reply(s.handlers, resp, err)
}

func (s hostService) PruneHostImages(ctx context.Context, r *connect.Request[eitriv1.PruneHostImagesRequest]) (*connect.Response[eitriv1.PruneHostImagesResponse], error) {
	resp, err := s.f.PruneHostImages(ctx, r.Msg.GetId())
	return reply(s.handlers, resp, err)
}
