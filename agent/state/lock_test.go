package state

import (
	"fmt"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestLockDirAdmitsOneHolderAndNamesIt(t *testing.T) {
	dir := t.TempDir()
	first, err := LockDir(dir)
	require.NoError(t, err)

	// flock belongs to the open file, so a second open in this process is
	// refused just as another process would be.
	_, err = LockDir(dir)
	require.ErrorIs(t, err, ErrLocked)
	assert.Contains(t, err.Error(), fmt.Sprintf("pid %d", os.Getpid()))
	assert.Contains(t, err.Error(), "already running")

	require.NoError(t, first.Release())
	again, err := LockDir(dir)
	require.NoError(t, err, "a released dir can be taken again")
	require.NoError(t, again.Release())
}
