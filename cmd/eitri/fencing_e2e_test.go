package main

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/wire/connclient"
)

// dbFiles are the control plane's database and its WAL companions.
var dbFiles = []string{"eitri.db", "eitri.db-wal", "eitri.db-shm"}

// backupDB copies the (stopped) control plane's database, as an operator's
// backup would.
func backupDB(t *testing.T, controlDir string) string {
	t.Helper()
	to := t.TempDir()
	for _, name := range dbFiles {
		b, err := os.ReadFile(filepath.Join(controlDir, name))
		if os.IsNotExist(err) {
			continue
		}
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(to, name), b, 0o600))
	}
	return to
}

// restoreDB puts a backup back in place of the (stopped) control plane's
// database.
func restoreDB(t *testing.T, backup, controlDir string) {
	t.Helper()
	for _, name := range dbFiles {
		_ = os.Remove(filepath.Join(controlDir, name))
		b, err := os.ReadFile(filepath.Join(backup, name))
		if os.IsNotExist(err) {
			continue
		}
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(controlDir, name), b, 0o600))
	}
}

// A control plane restored from a backup older than a VM must not cost the
// VM: the host keeps its guest running (the same QEMU), the control plane
// shows it as orphaned with its spec and owner, and an admin adopts it back
// with the same id and disk. Before fencing, the host stopped it at once
// and destroyed it a day later, and nothing showed it.
func TestAControlPlaneRestoredFromAnOlderBackupKeepsTheVMRunningForAnAdminToAdopt(t *testing.T) {
	if !inNetns(t) {
		return
	}
	// Short: QEMU's QMP socket path under it must fit in 107 bytes.
	dir, err := os.MkdirTemp("", "eitri-fence-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	controlDir, agentDir := filepath.Join(dir, "control"), filepath.Join(dir, "agent")
	imgURL, imgSum := slowImage(t, os.Getenv("EITRI_GUEST_IMAGE"))
	ctx := context.Background()

	dev := startDev(t, dir)
	dev.vms(t, dir) // the host has enrolled: the backup knows it
	dev.stop(t)
	backup := backupDB(t, controlDir)

	dev = startDev(t, dir)
	vms := dev.vms(t, dir)
	created, err := vms.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{Name: "web-1", ImageUrl: imgURL, ImageSha256: imgSum, Vcpus: 1, MemMb: 256, DiskGb: 1}))
	require.NoError(t, err)
	id := created.Msg.Vm.Id
	require.Eventually(t, func() bool {
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		if err == nil && r.Msg.Vm.Lifecycle == "failed" {
			t.Fatalf("the VM failed: %s", r.Msg.Vm.LastError)
		}
		return err == nil && r.Msg.Vm.Lifecycle == "ready"
	}, 4*time.Minute, 200*time.Millisecond, "the VM boots")
	pid := qemuPID(t, agentDir, id)
	dev.stop(t)
	require.True(t, alive(pid), "the guest outlives its agent")

	restoreDB(t, backup, controlDir)
	dev = startDev(t, dir)
	defer func() { dev.stop(t) }()
	vms = dev.vms(t, dir)

	var orphan *eitriv1.OrphanedVM
	require.Eventually(t, func() bool {
		r, err := vms.ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
		if err != nil || len(r.Msg.Vms) != 1 {
			return false
		}
		orphan = r.Msg.Vms[0]
		return true
	}, 30*time.Second, 100*time.Millisecond, "the restored control plane shows the VM it lost")
	assert.Equal(t, id, orphan.VmId)
	assert.Equal(t, "web-1", orphan.Name)
	assert.Equal(t, "admin", orphan.OwnerName)
	assert.Equal(t, imgURL, orphan.ImageUrl)
	assert.Equal(t, "running", orphan.PowerState)
	assert.Equal(t, "running", orphan.ActualPower)
	assert.False(t, orphan.HasRow)
	assert.NotEmpty(t, orphan.Reason)
	listed, err := vms.ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
	assert.Empty(t, listed.Msg.Vms, "the restored database has no row for it")

	// Through more than one resync of the agent: still the same guest.
	time.Sleep(7 * time.Second)
	assert.True(t, alive(pid), "the host keeps the guest running")
	assert.Equal(t, pid, qemuPID(t, agentDir, id))
	hosts := eitriv1connect.NewHostServiceClient(connclient.HTTPClient(""), "http://127.0.0.1:18080", adminAuth(t, dir))
	hl, err := hosts.ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
	require.NoError(t, err)
	require.Len(t, hl.Msg.Hosts, 1)
	var types []string
	for _, c := range hl.Msg.Hosts[0].Conditions {
		types = append(types, c.Type)
	}
	assert.Contains(t, types, fleet.ConditionOrphanedVMs)
	assert.NotContains(t, types, fleet.ConditionSnapshotRefused, "the control plane moved past what the agent applied before its first snapshot")

	adopted, err := vms.AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: orphan.HostId, VmId: id}))
	require.NoError(t, err)
	assert.Equal(t, id, adopted.Msg.Vm.Id)
	require.Eventually(t, func() bool {
		r, err := vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		return err == nil && r.Msg.Vm.Lifecycle == "ready" && r.Msg.Vm.AssignedIp != ""
	}, 30*time.Second, 100*time.Millisecond, "adopted, it is an ordinary VM again")
	assert.Equal(t, pid, qemuPID(t, agentDir, id), "the same guest: adopted, not rebuilt or rebooted")
	assert.True(t, alive(pid))
	require.Eventually(t, func() bool {
		r, err := vms.ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
		return err == nil && len(r.Msg.Vms) == 0
	}, 10*time.Second, 100*time.Millisecond, "no longer orphaned")
	hl, err = hosts.ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
	require.NoError(t, err)
	assert.False(t, slices.ContainsFunc(hl.Msg.Hosts[0].Conditions, func(c *eitriv1.HostCondition) bool { return c.Type == fleet.ConditionOrphanedVMs }))
}

func adminAuth(t *testing.T, dir string) connect.ClientOption {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	return connect.WithInterceptors(connclient.Bearer(strings.TrimSpace(string(b))))
}
