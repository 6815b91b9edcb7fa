package store

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/wire/vmstate"
)

func TestForgettingADeadHostKeepsItsVMsAsLostRows(t *testing.T) {
	eachEngine(t, testForgettingADeadHostKeepsItsVMsAsLostRows)
}

func testForgettingADeadHostKeepsItsVMsAsLostRows(t *testing.T, e engine) {
	s, _ := e.open(t)
	fixture(t, s)
	ctx := context.Background()
	live, gone, other := testVM("v1", "u2", "h1", "web", t0), testVM("v2", "u2", "h1", "old", t0.Add(time.Second)), testVM("v3", "u2", "h2", "db", t0)
	for _, v := range []VM{live, gone, other} {
		mustCreateVM(t, s, v)
	}
	_, _, err := s.UpdateVM(ctx, "v2", func(v *VM) error { v.DeletedAt, v.DestroyAt = ptr(t0), ptr(t0.Add(time.Hour)); return nil })
	require.NoError(t, err)
	require.NoError(t, s.CreateExposure(ctx, Exposure{ID: "x1", VMID: "v1", HostID: "h1", GuestPort: 80, HostPort: 30080, Protocol: "tcp", Scope: "lan"}))
	require.NoError(t, s.CreateExposure(ctx, Exposure{ID: "x2", VMID: "v3", HostID: "h2", GuestPort: 80, HostPort: 30080, Protocol: "tcp", Scope: "lan"}))
	require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v1", At: t0, Kind: "created"}))
	require.NoError(t, s.TouchHost(ctx, "h1", t0))

	at := t0.Add(time.Hour)
	loss, err := s.ForgetUnreachableHost(ctx, "h1", at.Add(-10*time.Minute), at, func(v VM) string { return "lost with beta: " + v.Name })
	require.NoError(t, err)

	require.Len(t, loss.Lost, 1)
	assert.Equal(t, "v1", loss.Lost[0].ID)
	assert.Empty(t, loss.Lost[0].HostID)
	require.Len(t, loss.Forgotten, 1)
	assert.Equal(t, "v2", loss.Forgotten[0].ID)
	require.Len(t, loss.Exposures, 1)
	assert.Equal(t, "x1", loss.Exposures[0].ID)

	v1, err := s.GetVM(ctx, "v1")
	require.NoError(t, err, "a lost VM stays as a row")
	assert.Equal(t, vmstate.LifecycleLost, v1.Status)
	assert.Equal(t, "lost with beta: web", v1.LastError)
	assert.Empty(t, v1.HostID)
	assert.Equal(t, "web", v1.Name, "spec, owner and name are kept")
	evs, err := s.ListVMEvents(ctx, "v1")
	require.NoError(t, err)
	assert.Len(t, evs, 1, "its history is kept")

	_, err = s.GetVM(ctx, "v2")
	assert.ErrorIs(t, err, ErrNotFound, "a deleted VM whose destroy can never be confirmed is gone")
	_, err = s.HostByID(ctx, "h1")
	assert.ErrorIs(t, err, ErrNotFound)
	_, err = s.GetExposure(ctx, "x1")
	assert.ErrorIs(t, err, ErrNotFound)

	v3, err := s.GetVM(ctx, "v3")
	require.NoError(t, err)
	assert.Equal(t, "h2", v3.HostID, "another host's VMs are untouched")
	_, err = s.GetExposure(ctx, "x2")
	assert.NoError(t, err)
}

func TestAHostSeenAfterTheCutoffIsNotForgotten(t *testing.T) {
	eachEngine(t, testAHostSeenAfterTheCutoffIsNotForgotten)
}

func testAHostSeenAfterTheCutoffIsNotForgotten(t *testing.T, e engine) {
	s, _ := e.open(t)
	fixture(t, s)
	ctx := context.Background()
	mustCreateVM(t, s, testVM("v1", "u2", "h1", "web", t0))
	// It came back between the caller's check and the write.
	require.NoError(t, s.TouchHost(ctx, "h1", t0.Add(time.Hour)))

	_, err := s.ForgetUnreachableHost(ctx, "h1", t0.Add(50*time.Minute), t0.Add(time.Hour), func(VM) string { return "lost" })
	require.ErrorIs(t, err, ErrConflict)

	v1, err := s.GetVM(ctx, "v1")
	require.NoError(t, err)
	assert.Equal(t, "h1", v1.HostID, "nothing was written")
	assert.NotEqual(t, vmstate.LifecycleLost, v1.Status)
	_, err = s.HostByID(ctx, "h1")
	assert.NoError(t, err)
}

func TestAHostThatNeverConnectedCountsFromItsEnrolment(t *testing.T) {
	eachEngine(t, testAHostThatNeverConnectedCountsFromItsEnrolment)
}

func testAHostThatNeverConnectedCountsFromItsEnrolment(t *testing.T, e engine) {
	s, _ := e.open(t)
	fixture(t, s) // h1 created at t0, never seen
	ctx := context.Background()
	_, err := s.ForgetUnreachableHost(ctx, "h1", t0.Add(-time.Minute), t0, func(VM) string { return "" })
	require.ErrorIs(t, err, ErrConflict)
	_, err = s.ForgetUnreachableHost(ctx, "h1", t0.Add(time.Minute), t0.Add(time.Hour), func(VM) string { return "" })
	require.NoError(t, err)
}
