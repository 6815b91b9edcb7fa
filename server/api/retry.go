package api

import (
	"context"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func (s vmService) RetryVM(ctx context.Context, r *connect.Request[eitriv1.RetryVMRequest]) (*connect.Response[eitriv1.RetryVMResponse], error) {
	vm, err := s.f.RetryVM(ctx, r.Msg.GetId())
	return reply(s.handlers, &eitriv1.RetryVMResponse{Vm: vm}, err)
}
