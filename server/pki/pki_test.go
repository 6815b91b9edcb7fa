package pki

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFirstStartMakesACertificateAndLaterStartsKeepIt(t *testing.T) {
	dir := t.TempDir()
	a, err := LoadOrCreate(dir, []string{"cp.example", "10.1.2.3"})
	require.NoError(t, err)
	assert.Contains(t, a.Leaf.DNSNames, "cp.example")
	b, err := LoadOrCreate(dir, nil)
	require.NoError(t, err)
	assert.Equal(t, Fingerprint(a.Certificate[0]), Fingerprint(b.Certificate[0]), "a restart must not change the pinned identity")
}
