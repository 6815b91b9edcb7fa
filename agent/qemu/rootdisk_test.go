package qemu

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/a73x/eitri/agent/hosttest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// recordSyncs makes fsync note every path it flushes, in order.
func recordSyncs(t *testing.T) func() []string {
	var mu sync.Mutex
	var synced []string
	orig := fsync
	fsync = func(f *os.File) error {
		mu.Lock()
		synced = append(synced, f.Name())
		mu.Unlock()
		return orig(f)
	}
	t.Cleanup(func() { fsync = orig })
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), synced...)
	}
}

// A power loss right after PrepareRootDisk returned must not leave a root
// disk that exists but is empty: the overlay is flushed before it is renamed
// into place, and the directory (rename and pin) after.
func TestARootDiskIsOnDiskBeforePrepareRootDiskReturns(t *testing.T) {
	hosttest.NeedQEMU(t)
	synced := recordSyncs(t)
	b := newBackend(t, 0)
	base := filepath.Join(t.TempDir(), "base.raw")
	sparseFile(t, base, 1<<30)
	dst := filepath.Join(b.VMDir("vm1"), "root.qcow2")
	require.NoError(t, b.PrepareRootDisk(context.Background(), dst, base, 2))
	assert.Equal(t, []string{dst + ".tmp", filepath.Dir(dst)}, synced())
}

// A root disk a power loss left empty (an agent that did not sync) would
// boot as a blank raw disk; it is made again as an overlay instead.
func TestARootDiskTornByAPowerLossIsMadeAgainNotBootedBlank(t *testing.T) {
	hosttest.NeedQEMU(t)
	b := newBackend(t, 0)
	base := filepath.Join(t.TempDir(), "base.raw")
	sparseFile(t, base, 1<<30)
	dst := filepath.Join(b.VMDir("vm1"), "root.qcow2")
	require.NoError(t, os.MkdirAll(filepath.Dir(dst), 0o700))
	for _, torn := range [][]byte{nil, make([]byte, 4096)} {
		require.NoError(t, os.WriteFile(dst, torn, 0o600))
		require.NoError(t, b.PrepareRootDisk(context.Background(), dst, base, 2))
		info := qemuImgInfo(t, dst)
		assert.Equal(t, "qcow2", info.Format)
		assert.Equal(t, int64(2<<30), info.VirtualSize)
		assert.Equal(t, dst+".base", info.BackingFile)
	}
}
