package api

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func (s vmService) ListOrphanedVMs(ctx context.Context, _ *connect.Request[eitriv1.ListOrphanedVMsRequest]) (*connect.Response[eitriv1.ListOrphanedVMsResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("not yet"))
}

func (s vmService) AdoptOrphanedVM(ctx context.Context, r *connect.Request[eitriv1.AdoptOrphanedVMRequest]) (*connect.Response[eitriv1.AdoptOrphanedVMResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("not yet"))
}

func (s vmService) DestroyOrphanedVM(ctx context.Context, r *connect.Request[eitriv1.DestroyOrphanedVMRequest]) (*connect.Response[eitriv1.DestroyOrphanedVMResponse], error) {
	return nil, connect.NewError(connect.CodeUnimplemented, errors.New("not yet"))
}
