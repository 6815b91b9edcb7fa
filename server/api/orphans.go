package api

import (
	"context"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func (s vmService) ListOrphanedVMs(ctx context.Context, _ *connect.Request[eitriv1.ListOrphanedVMsRequest]) (*connect.Response[eitriv1.ListOrphanedVMsResponse], error) {
	vms, err := s.f.ListOrphanedVMs(ctx)
	return reply(s.handlers, &eitriv1.ListOrphanedVMsResponse{Vms: vms}, err)
}

func (s vmService) AdoptOrphanedVM(ctx context.Context, r *connect.Request[eitriv1.AdoptOrphanedVMRequest]) (*connect.Response[eitriv1.AdoptOrphanedVMResponse], error) {
	vm, err := s.f.AdoptOrphanedVM(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.AdoptOrphanedVMResponse{Vm: vm}, err)
}

func (s vmService) DestroyOrphanedVM(ctx context.Context, r *connect.Request[eitriv1.DestroyOrphanedVMRequest]) (*connect.Response[eitriv1.DestroyOrphanedVMResponse], error) {
	err := s.f.DestroyOrphanedVM(ctx, r.Msg)
	return reply(s.handlers, &eitriv1.DestroyOrphanedVMResponse{}, err)
}
