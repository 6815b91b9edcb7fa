package api

import (
	"context"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/watch"
)

type imageService struct{ handlers }

func (s imageService) AddImage(ctx context.Context, r *connect.Request[eitriv1.AddImageRequest]) (*connect.Response[eitriv1.AddImageResponse], error) {
	img, err := s.f.AddImage(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.AddImageResponse{Image: img}, err)
}

func (s imageService) GetImage(ctx context.Context, r *connect.Request[eitriv1.GetImageRequest]) (*connect.Response[eitriv1.GetImageResponse], error) {
	img, err := s.f.GetImage(ctx, r.Msg.GetName())
	return reply(s.handlers, &eitriv1.GetImageResponse{Image: img}, err)
}

func (s imageService) ListImages(ctx context.Context, _ *connect.Request[eitriv1.ListImagesRequest]) (*connect.Response[eitriv1.ListImagesResponse], error) {
	list, err := s.f.ListImages(ctx)
	return reply(s.handlers, &eitriv1.ListImagesResponse{Images: list}, err)
}

func (s imageService) DeleteImage(ctx context.Context, r *connect.Request[eitriv1.DeleteImageRequest]) (*connect.Response[eitriv1.DeleteImageResponse], error) {
	err := s.f.DeleteImage(ctx, r.Msg.GetName())
	return reply(s.handlers, &eitriv1.DeleteImageResponse{}, err)
}

func (s imageService) RefreshImage(ctx context.Context, r *connect.Request[eitriv1.RefreshImageRequest]) (*connect.Response[eitriv1.RefreshImageResponse], error) {
	img, changed, err := s.f.RefreshImage(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.RefreshImageResponse{Image: img, Changed: changed}, err)
}

func (s imageService) PullImage(ctx context.Context, r *connect.Request[eitriv1.PullImageRequest]) (*connect.Response[eitriv1.PullImageResponse], error) {
	img, err := s.f.PullImage(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.PullImageResponse{Image: img}, err)
}

func (s imageService) WatchImages(ctx context.Context, r *connect.Request[eitriv1.WatchImagesRequest], out *connect.ServerStream[eitriv1.WatchImagesResponse]) error {
	w, list, err := s.f.WatchImages(ctx, r.Msg.GetName())
	if err != nil {
		return s.toConnect(err)
	}
	first := &eitriv1.WatchImagesResponse{Event: &eitriv1.WatchImagesResponse_Snapshot{Snapshot: &eitriv1.ImageList{Images: list}}}
	return stream(ctx, s.handlers, w, first, out, func(ev watch.Event[*eitriv1.Image]) *eitriv1.WatchImagesResponse {
		if ev.Removed {
			return &eitriv1.WatchImagesResponse{Event: &eitriv1.WatchImagesResponse_RemovedName{RemovedName: ev.ID}}
		}
		return &eitriv1.WatchImagesResponse{Event: &eitriv1.WatchImagesResponse_Changed{Changed: ev.Obj}}
	})
}
