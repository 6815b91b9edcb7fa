package fleet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/registry"
	"github.com/a73x/eitri/server/store"
)

// A report lands in the registry a moment before its durable fields land
// in the store; a view built in that moment shows the report whole.
func TestAViewShowsTheDurableFieldsOfTheLiveReportBeforeTheStoreHasThem(t *testing.T) {
	f := &Fleet{reg: registry.New()}
	now := time.Now()
	conn, _ := f.reg.Connect("h1", &eitriv1.Hello{}, now)
	vm := store.VM{ID: "vm-1", HostID: "h1", Status: "failed", LastError: "disk full", PowerState: "running", Retry: 1}

	before := f.vmView(vm)
	assert.Empty(t, before.GetSshHostPubkey())

	_, ok := f.reg.Apply("h1", conn, &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{{
		VmId: "vm-1", Phase: "ready", Power: "running", Ip: "10.0.0.5", SshHostPubkey: "ssh-ed25519 AAAA",
	}}}, now)
	assert.True(t, ok)
	live := f.vmView(vm)
	assert.Equal(t, "ready", live.GetLifecycle())
	assert.Equal(t, "10.0.0.5", live.GetAssignedIp())
	assert.Equal(t, "ssh-ed25519 AAAA", live.GetSshHostPubkey(), "ready comes with its host key")
	assert.Equal(t, "ready", live.GetStatus(), "the status the store is about to hold")
	assert.Empty(t, live.GetLastError(), "a ready VM has no error left")

	// A failure sent before the host saw the retry is not the VM's status:
	// the retried VM stays pending until the host answers.
	vm.Status = "pending"
	_, ok = f.reg.Apply("h1", conn, &eitriv1.ActualStateReport{Vms: []*eitriv1.ActualVM{{
		VmId: "vm-1", Phase: "failed", Power: "stopped", LastError: "old failure", Retry: 0,
	}}}, now)
	assert.True(t, ok)
	stale := f.vmView(vm)
	assert.Equal(t, "retrying", stale.GetLifecycle())
	assert.Equal(t, "pending", stale.GetStatus())

	// The host gone, the durable copy speaks.
	f.reg.Disconnect("h1", conn)
	vm.SSHHostPubkey, vm.AssignedIP = "ssh-ed25519 BBBB", "10.0.0.6"
	gone := f.vmView(vm)
	assert.Equal(t, "ssh-ed25519 BBBB", gone.GetSshHostPubkey())
	assert.Equal(t, "10.0.0.6", gone.GetAssignedIp())
}
