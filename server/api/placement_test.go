package api_test

import (
	"context"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestNoRoomSaysWhatHoldsEachHostsCapacity(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("rack-1")
	e.connect(h, cred, &eitriv1.Capacity{Vcpus: 4, MemMb: 4096, DiskGb: 20})
	e.enroll("rack-2") // enrolled, never connected

	r := createReq("web-1")
	r.Vcpus, r.MemMb, r.DiskGb = 2, 2048, 5
	e.mustCreateVM(e.admin, r)
	r.Name = "old"
	old := e.mustCreateVM(e.admin, r)
	_, err := e.vms(e.admin).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: old.Id}))
	require.NoError(t, err)

	// 2 vCPUs are free, and 10 GiB of disk: 5 of the 10 allocated are a
	// deleted VM's, kept for a restore.
	r.Name, r.Vcpus, r.DiskGb = "big", 3, 1
	_, err = e.vms(e.admin).CreateVM(ctx, connect.NewRequest(r))
	require.Equal(t, connect.CodeFailedPrecondition, code(err))
	msg := err.Error()
	assert.Contains(t, msg, "no connected host has room for 3 vCPU, 2048 MiB memory and 1 GiB disk")
	assert.Contains(t, msg, "rack-1 has 2/4 vCPU, 2048/4096 MiB memory, 10/20 GiB disk allocated to 1 VM(s)")
	assert.Contains(t, msg, "1 deleted VM(s) keeping 5 GiB disk until destroyed")
	assert.Contains(t, msg, "free: 2 vCPU, 2048 MiB, 10 GiB")
	assert.Contains(t, msg, "rack-2 is not connected")
}

func TestNoRoomWithoutAnyHostSaysHowToAddOne(t *testing.T) {
	e := newEnv(t)
	_, err := e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(createReq("web-1")))
	require.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "no host is enrolled")
}

func TestNoRoomNamesAtMostEightHosts(t *testing.T) {
	e := newEnv(t)
	for range 10 {
		e.enroll("idle")
	}
	_, err := e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(createReq("web-1")))
	require.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.Contains(t, err.Error(), "and 2 more host(s)")
}
