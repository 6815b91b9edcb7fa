package api

import (
	"context"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

type sshService struct{ handlers }

// GetSSHCAKeys returns the SSH CAs' public keys.
func (s sshService) GetSSHCAKeys(ctx context.Context, _ *connect.Request[eitriv1.GetSSHCAKeysRequest]) (*connect.Response[eitriv1.GetSSHCAKeysResponse], error) {
	out, err := s.f.SSHCAKeys(ctx)
	return reply(s.handlers, out, err)
}

// SignUserKey certifies the caller's key for one of their VMs.
func (s sshService) SignUserKey(ctx context.Context, r *connect.Request[eitriv1.SignUserKeyRequest]) (*connect.Response[eitriv1.SignUserKeyResponse], error) {
	out, err := s.f.SignUserKey(ctx, r.Msg)
	return reply(s.handlers, out, err)
}

// RotateSSHCA replaces one CA's key.
func (s sshService) RotateSSHCA(ctx context.Context, r *connect.Request[eitriv1.RotateSSHCARequest]) (*connect.Response[eitriv1.RotateSSHCAResponse], error) {
	keys, err := s.f.RotateSSHCA(ctx, r.Msg.GetCa())
	return reply(s.handlers, &eitriv1.RotateSSHCAResponse{Keys: keys}, err)
}

// SignHostKey certifies a guest's host key for the host that runs it.
func (s agentService) SignHostKey(ctx context.Context, r *connect.Request[eitriv1.SignHostKeyRequest]) (*connect.Response[eitriv1.SignHostKeyResponse], error) {
	hostID, err := s.hostOf(ctx, r.Header())
	if err != nil {
		return nil, err
	}
	out, err := s.f.SignHostKey(ctx, hostID, r.Msg)
	return reply(s.handlers, out, err)
}
