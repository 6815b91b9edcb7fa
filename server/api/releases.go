package api

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"github.com/go-chi/chi/v5"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/server/watch"
)

// MaxReleaseChunk bounds one UploadRelease message's bytes.
const MaxReleaseChunk = 1 << 20

// ReleasesPath is where agents fetch builds: ReleasesPath + sha256.
const ReleasesPath = "/releases/"

// MountReleases serves builds to agents (the route's guard checks the host
// credential). http.ServeContent answers ranges, which is what lets an
// agent resume a download cut off halfway.
func MountReleases(r chi.Router, f *fleet.Fleet) {
	r.Get(ReleasesPath+"{sha256}", func(w http.ResponseWriter, req *http.Request) {
		rel, data, err := f.ReleaseForHost(req.Context(), chi.URLParam(req, "sha256"))
		if err != nil {
			code := http.StatusInternalServerError
			if fleet.KindOf(err) == fleet.NotFound {
				code = http.StatusNotFound
			}
			http.Error(w, err.Error(), code)
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("ETag", `"`+rel.SHA256+`"`)
		http.ServeContent(w, req, "", rel.UploadedAt, bytes.NewReader(data))
	})
}

type releaseService struct{ handlers }

func (s releaseService) UploadRelease(ctx context.Context, st *connect.ClientStream[eitriv1.UploadReleaseRequest]) (*connect.Response[eitriv1.UploadReleaseResponse], error) {
	var sig []byte
	var data bytes.Buffer
	for st.Receive() {
		switch part := st.Msg().GetPart().(type) {
		case *eitriv1.UploadReleaseRequest_Signature:
			if sig != nil || data.Len() > 0 {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("signature: send it once, first"))
			}
			if len(part.Signature) > fleet.MaxSignatureSize {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("signature: too large to be one"))
			}
			sig = part.Signature
		case *eitriv1.UploadReleaseRequest_Chunk:
			if sig == nil {
				return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("signature: send it before the build"))
			}
			if data.Len()+len(part.Chunk) > fleet.MaxReleaseSize {
				return nil, connect.NewError(connect.CodeResourceExhausted,
					fmt.Errorf("the build is larger than the %d MiB a control plane takes", fleet.MaxReleaseSize>>20))
			}
			data.Write(part.Chunk)
		}
	}
	if err := st.Err(); err != nil {
		return nil, err
	}
	if sig == nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New("signature: required"))
	}
	rel, err := s.f.UploadRelease(ctx, sig, data.Bytes())
	return reply(s.handlers, &eitriv1.UploadReleaseResponse{Release: rel}, err)
}

func (s releaseService) ListReleases(ctx context.Context, _ *connect.Request[eitriv1.ListReleasesRequest]) (*connect.Response[eitriv1.ListReleasesResponse], error) {
	list, err := s.f.ListReleases(ctx)
	return reply(s.handlers, &eitriv1.ListReleasesResponse{Releases: list}, err)
}

func (s releaseService) DeleteRelease(ctx context.Context, r *connect.Request[eitriv1.DeleteReleaseRequest]) (*connect.Response[eitriv1.DeleteReleaseResponse], error) {
	err := s.f.DeleteRelease(ctx, strings.ToLower(r.Msg.GetSha256()))
	return reply(s.handlers, &eitriv1.DeleteReleaseResponse{}, err)
}

func (s releaseService) StartRollout(ctx context.Context, r *connect.Request[eitriv1.StartRolloutRequest]) (*connect.Response[eitriv1.StartRolloutResponse], error) {
	ro, err := s.f.StartRollout(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.StartRolloutResponse{Rollout: ro}, err)
}

func (s releaseService) GetRollout(ctx context.Context, r *connect.Request[eitriv1.GetRolloutRequest]) (*connect.Response[eitriv1.GetRolloutResponse], error) {
	ro, err := s.f.GetRollout(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.GetRolloutResponse{Rollout: ro}, err)
}

func (s releaseService) ListRollouts(ctx context.Context, _ *connect.Request[eitriv1.ListRolloutsRequest]) (*connect.Response[eitriv1.ListRolloutsResponse], error) {
	list, err := s.f.ListRollouts(ctx)
	return reply(s.handlers, &eitriv1.ListRolloutsResponse{Rollouts: list}, err)
}

func (s releaseService) PauseRollout(ctx context.Context, r *connect.Request[eitriv1.PauseRolloutRequest]) (*connect.Response[eitriv1.PauseRolloutResponse], error) {
	ro, err := s.f.PauseRollout(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.PauseRolloutResponse{Rollout: ro}, err)
}

func (s releaseService) ResumeRollout(ctx context.Context, r *connect.Request[eitriv1.ResumeRolloutRequest]) (*connect.Response[eitriv1.ResumeRolloutResponse], error) {
	ro, err := s.f.ResumeRollout(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.ResumeRolloutResponse{Rollout: ro}, err)
}

func (s releaseService) AbortRollout(ctx context.Context, r *connect.Request[eitriv1.AbortRolloutRequest]) (*connect.Response[eitriv1.AbortRolloutResponse], error) {
	ro, err := s.f.AbortRollout(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.AbortRolloutResponse{Rollout: ro}, err)
}

func (s releaseService) WatchRollouts(ctx context.Context, _ *connect.Request[eitriv1.WatchRolloutsRequest], out *connect.ServerStream[eitriv1.WatchRolloutsResponse]) error {
	w, list, err := s.f.WatchRollouts(ctx)
	if err != nil {
		return s.toConnect(err)
	}
	first := &eitriv1.WatchRolloutsResponse{Event: &eitriv1.WatchRolloutsResponse_Snapshot{Snapshot: &eitriv1.RolloutList{Rollouts: list}}}
	return stream(ctx, s.handlers, w, first, out, func(ev watch.Event[*eitriv1.Rollout]) *eitriv1.WatchRolloutsResponse {
		return &eitriv1.WatchRolloutsResponse{Event: &eitriv1.WatchRolloutsResponse_Changed{Changed: ev.Obj}}
	})
}
