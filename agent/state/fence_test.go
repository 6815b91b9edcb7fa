package state

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestTheAppliedLineageSurvivesARestart(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	require.NoError(t, err)
	_, ok, err := s.LoadLineage()
	require.NoError(t, err)
	assert.False(t, ok)
	want := Lineage{ControlPlaneID: "cp_x", Epoch: 2, Generation: 1 << 62}
	require.NoError(t, s.SaveLineage(want))

	s2, err := Open(dir)
	require.NoError(t, err)
	got, ok, err := s2.LoadLineage()
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, want, got)
}

// A destroyed VM is remembered across restarts, even after its record and
// data are gone, so its id is never built again from nothing.
func TestADestroyedVMIsRememberedAfterItsRecordIsGone(t *testing.T) {
	dir := t.TempDir()
	s, err := Open(dir)
	require.NoError(t, err)
	require.NoError(t, s.SaveVM("vm-1", Record{Spec: VMSpec{ID: "vm-1"}}))
	at := time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)
	require.NoError(t, s.MarkDestroyed("vm-1", at))
	require.NoError(t, s.DeleteVM("vm-1"))
	assert.Error(t, s.MarkDestroyed("../x", at), "ids never reach the filesystem unchecked")

	s2, err := Open(dir)
	require.NoError(t, err)
	got, err := s2.Destroyed()
	require.NoError(t, err)
	assert.Equal(t, map[string]time.Time{"vm-1": at}, got)
	ids, err := s2.ListVMs()
	require.NoError(t, err)
	assert.Empty(t, ids)

	// A damaged mark still counts.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "destroyed", "vm-2.json"), []byte("{"), 0o600))
	got, err = s2.Destroyed()
	require.NoError(t, err)
	assert.Contains(t, got, "vm-2")
}
