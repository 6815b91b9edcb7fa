package api_test

import (
	"context"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestAVMSeededBeforeAUserCARotationIsFlaggedStaleAndANewOneIsNot(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	old := e.mustCreateVM(e.admin, createReq("old"))
	require.Len(t, old.GetTrustedCas(), 1, "the CA its seed trusts is shown")
	assert.True(t, old.GetTrustedCas()[0].GetCurrent())
	assert.Contains(t, old.GetTrustedCas()[0].GetFingerprint(), "SHA256:")
	assert.False(t, old.GetTrustStale())
	seeded := a.nextWhere(t, func(s *eitriv1.DesiredStateSnapshot) bool { return len(s.GetVms()) == 1 }, "the VM is sent")
	assert.Equal(t, []string{old.GetTrustedCas()[0].GetPublicKey()}, seeded.GetVms()[0].GetSshUserCaKeys(),
		"the seed gets exactly the keys the VM shows")

	_, err := e.ssh(e.admin).RotateSSHCA(ctx, connect.NewRequest(&eitriv1.RotateSSHCARequest{Ca: "user"}))
	require.NoError(t, err)

	got, err := e.vms(e.admin).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: old.GetId()}))
	require.NoError(t, err)
	v := got.Msg.GetVm()
	assert.True(t, v.GetTrustStale(), "its guest trusts only the rotated-out key")
	assert.False(t, v.GetTrustedCas()[0].GetCurrent())
	assert.Contains(t, v.GetTrustFix(), "eitri ssh-ca")
	assert.Contains(t, v.GetTrustFix(), "recreate the VM")
	snap := a.nextWhere(t, func(s *eitriv1.DesiredStateSnapshot) bool { return len(s.GetVms()) == 1 }, "a snapshot after the rotation")
	assert.Equal(t, seeded.GetVms()[0].GetSshUserCaKeys(), snap.GetVms()[0].GetSshUserCaKeys(), "what the VM shows is still what it is sent")

	fresh := e.mustCreateVM(e.admin, createReq("fresh"))
	assert.False(t, fresh.GetTrustStale())
	require.Len(t, fresh.GetTrustedCas(), 2, "a new VM trusts the current key and the kept previous one")
	assert.True(t, fresh.GetTrustedCas()[0].GetCurrent())
}
