package agent

import (
	"context"
	"errors"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/state"
)

func openState(t *testing.T) *state.Store {
	t.Helper()
	st, err := state.Open(filepath.Join(t.TempDir(), "state"))
	require.NoError(t, err)
	return st
}

func TestAnEnrolledHostKeepsItsIdentityAndIgnoresAJoinToken(t *testing.T) {
	st := openState(t)
	saved := state.Identity{HostID: "h-1", Credential: "secret", ServerURL: "https://cp:7443", Fingerprint: "ab"}
	require.NoError(t, st.SaveIdentity(saved))
	var logs hosttest.LogBuffer
	got, err := identity(context.Background(), st, Config{
		JoinToken:     "eitri_join_x",
		MintJoinToken: func(context.Context) (string, error) { t.Fatal("an enrolled host mints no token"); return "", nil },
	}, logs.Logger())
	require.NoError(t, err)
	assert.Equal(t, saved, got, "the identity the store kept, as it is")
	assert.Contains(t, logs.String(), "already enrolled; ignoring --join")
}

func TestAHostWithNoIdentityEnrollsWithTheTokenItIsGivenOrMints(t *testing.T) {
	var logs hosttest.LogBuffer
	_, err := identity(context.Background(), openState(t), Config{}, logs.Logger())
	assert.ErrorContains(t, err, "this host is not enrolled: run it once with --join <token>")

	// eitri dev's agent mints its own token when given none.
	minted := errors.New("mint refused")
	_, err = identity(context.Background(), openState(t), Config{
		MintJoinToken: func(context.Context) (string, error) { return "", minted },
	}, logs.Logger())
	assert.ErrorIs(t, err, minted)

	// A token that does not decode is refused before anything is saved.
	st := openState(t)
	_, err = identity(context.Background(), st, Config{JoinToken: "not-a-token"}, logs.Logger())
	require.Error(t, err)
	_, ok, err := st.LoadIdentity()
	require.NoError(t, err)
	assert.False(t, ok, "no identity is kept from a failed enrolment")
}

func TestTheAdmissionCheckAndTheReportReadOneMeasure(t *testing.T) {
	c := hostCapacity(t.TempDir())
	r, err := c.resources()
	require.NoError(t, err)
	require.Positive(t, r.VCPUs)
	rep := c.report()
	require.NotNil(t, rep)
	assert.Equal(t, r.VCPUs, int64(rep.GetVcpus()))
	assert.Equal(t, r.MemMB, rep.GetMemMb())
	assert.Equal(t, r.DiskGB, rep.GetDiskGb())

	assert.Nil(t, hostCapacity(filepath.Join(t.TempDir(), "missing")).report(), "unmeasured is not reported, rather than zero")
}
