package api_test

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// The attack: a tenant names their VM after another VM's alias (or id, or
// "localhost"), so the host certificate their guest gets, and they hold as
// root in it, would pass for that name. Such names are refused, and the
// certificate of a VM named anything names only its id and alias.
func TestAVMCannotBeNamedLikeAnotherVMsIDOrAliasOrLocalhost(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	alice, bob := e.user("alice"), e.user("bob")
	id := e.mustCreateVM(alice, createReq("web")).Id

	for _, name := range []string{"eitri-" + id, id, "localhost", "vm-xxxx", "eitri-web"} {
		_, err := e.vms(bob).CreateVM(ctx, connect.NewRequest(createReq(name)))
		require.Equal(t, connect.CodeInvalidArgument, code(err), name)
		assert.ErrorContains(t, err, "name: ", name)
	}
	list, err := e.vms(bob).ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
	assert.Empty(t, list.Msg.Vms, "nothing was created")

	for _, name := range []string{"vm", "vmx-1", "my-eitri-1", "localhost2"} {
		_, err := e.vms(bob).CreateVM(ctx, connect.NewRequest(createReq(name)))
		assert.NoError(t, err, "%s is an ordinary name", name)
	}
}

// Adopting an orphan sets its name too: one its host held under a name
// that is refused now is adopted only under another.
func TestAnOrphanHeldUnderAnAliasShapedNameIsAdoptedOnlyUnderAnother(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	mine := e.mustCreateVM(e.admin, createReq("db"))
	held := &eitriv1.VMDesired{VmId: "vm-lost", Name: "eitri-" + mine.Id, ImageUrl: "http://images.test/g.raw", ImageSha256: sha,
		Vcpus: 1, MemMb: 512, DiskGb: 4, PowerState: "stopped", Owner: mine.OwnerId, Version: 7}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Quarantined: []*eitriv1.QuarantinedVM{{VmId: "vm-lost", Name: held.Name, Held: held, Power: "stopped"}}})
	require.Eventually(t, func() bool {
		r, err := e.vms(e.admin).ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
		return err == nil && len(r.Msg.Vms) == 1
	}, 5*time.Second, 10*time.Millisecond)

	_, err := e.vms(e.admin).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: "vm-lost"}))
	require.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "name: ")
	assert.ErrorContains(t, err, "pass name")
	_, err = e.vms(e.admin).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: "vm-lost", Name: "localhost"}))
	require.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "name: ")

	adopted, err := e.vms(e.admin).AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: h, VmId: "vm-lost", Name: "db-2"}))
	require.NoError(t, err)
	assert.Equal(t, "db-2", adopted.Msg.Vm.Name)
}
