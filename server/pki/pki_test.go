package pki

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/wire/connclient"
)

func TestFirstStartMakesACertificateAndLaterStartsKeepIt(t *testing.T) {
	dir := t.TempDir()
	a, err := LoadOrCreate(dir, []string{"cp.example", "10.1.2.3"})
	require.NoError(t, err)
	assert.Contains(t, a.Leaf.DNSNames, "cp.example")
	b, err := LoadOrCreate(dir, nil)
	require.NoError(t, err)
	assert.Equal(t, connclient.Fingerprint(a.Certificate[0]), connclient.Fingerprint(b.Certificate[0]), "a restart must not change the pinned identity")
}

// The identity is pinned by every join token handed out after the first
// start, so a power loss must not undo it: each file is flushed before it is
// renamed into place and the directory after, all before LoadOrCreate
// returns; no work file is left.
func TestTLSIdentityIsOnDiskBeforeItIsUsed(t *testing.T) {
	var synced []string
	orig := fsync
	fsync = func(f *os.File) error {
		synced = append(synced, filepath.Base(f.Name()))
		return orig(f)
	}
	t.Cleanup(func() { fsync = orig })

	dir := filepath.Join(t.TempDir(), "tls")
	_, err := LoadOrCreate(dir, nil)
	require.NoError(t, err)
	want := []string{}
	for _, name := range []string{"ca.crt", "ca.key", "server.key", "server.crt"} {
		want = append(want, name+".tmp", "tls")
	}
	assert.Equal(t, want, synced)
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	assert.ElementsMatch(t, []string{"ca.crt", "ca.key", "server.crt", "server.key"}, names)
}
