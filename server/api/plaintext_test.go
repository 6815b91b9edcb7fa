package api_test

import (
	"context"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// The attack: a user names a token "a\x00b". PostgreSQL cannot store it, so
// one such row rolled a whole migrate-db back. Every text field of every
// request is refused with a NUL in it, naming the field, and nothing is
// written; a stream's request too.
func TestANULInAnyTextFieldIsRefusedNamingTheField(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	alice := e.user("alice")

	_, err := e.tokens(alice).CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "a\x00b"}))
	require.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "name: contains a NUL byte")
	list, err := e.tokens(alice).ListTokens(ctx, connect.NewRequest(&eitriv1.ListTokensRequest{}))
	require.NoError(t, err)
	for _, tok := range list.Msg.GetTokens() {
		assert.NotContains(t, tok.GetName(), "\x00")
	}

	req := createReq("web")
	req.SshAuthorizedKey = "ssh-ed25519 AAAA\x00"
	_, err = e.vms(alice).CreateVM(ctx, connect.NewRequest(req))
	require.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "ssh_authorized_key: contains a NUL byte")
	vms, err := e.vms(alice).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
	assert.Empty(t, vms.Msg.GetVms(), "nothing was created")

	stream, err := e.vms(alice).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{VmId: "vm-\x00"}))
	require.NoError(t, err)
	defer stream.Close()
	assert.False(t, stream.Receive())
	require.Equal(t, connect.CodeInvalidArgument, code(stream.Err()))
	assert.ErrorContains(t, stream.Err(), "vm_id: contains a NUL byte")
}
