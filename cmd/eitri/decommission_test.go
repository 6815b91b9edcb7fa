package main

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/vmstate"
)

func TestHostDecommissionForceMarksADeadHostsVMsLost(t *testing.T) {
	var mu sync.Mutex
	now := time.Now().UTC()
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	e := newCLIEnv(t, server.Config{Now: clock})
	eitri, srv := e.eitri, e.srv

	// A host that ran a VM and then went silent for good.
	ctx := context.Background()
	admin, err := srv.Fleet.Resolve(ctx, srv.AdminToken)
	require.NoError(t, err)
	seen := now.Add(-5 * time.Minute)
	require.NoError(t, srv.Store.CreateHost(ctx, store.Host{ID: "h-dead", Name: "rack9", CredentialHash: []byte("x"), CreatedAt: seen, LastSeenAt: &seen}))
	_, err = srv.Store.CreateVM(ctx, store.VM{ID: "vm-1", OwnerID: admin.UserID, HostID: "h-dead", Name: "web",
		ImageURL: "http://x/y.raw", VCPUs: 1, MemMB: 256, DiskGB: 1, PowerState: vmstate.PowerRunning, Status: "ready"})
	require.NoError(t, err)

	_, err = eitri("host", "decommission", "h-dead")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "with force")

	_, err = eitri("host", "decommission", "h-dead", "--force")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "try again in 5m0s")

	mu.Lock()
	now = now.Add(5 * time.Minute)
	mu.Unlock()
	out, err := eitri("host", "decommission", "h-dead", "--force")
	require.NoError(t, err)
	assert.Contains(t, out, "decommissioned h-dead by force")
	assert.Contains(t, out, "1 VM(s) marked lost")
	assert.Contains(t, out, "vm-1")

	out, err = eitri("vm", "ls")
	require.NoError(t, err)
	assert.Regexp(t, `vm-1\s+web\s+.*lost.*rack9.*decommissioned by force`, out)
}
