// Package seedtest reads back the NoCloud seeds the agent writes, for the
// tests of every package that checks what a guest would be given.
package seedtest

import (
	"io"
	"os"
	"testing"

	"github.com/kdomanski/iso9660"
	"github.com/stretchr/testify/require"
)

// Read returns a seed image's volume label and every root file's contents.
func Read(t testing.TB, path string) (label string, files map[string]string) {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	img, err := iso9660.OpenImage(f)
	require.NoError(t, err)
	label, err = img.Label()
	require.NoError(t, err)
	root, err := img.RootDir()
	require.NoError(t, err)
	children, err := root.GetChildren()
	require.NoError(t, err)
	files = map[string]string{}
	for _, c := range children {
		b, err := io.ReadAll(c.Reader())
		require.NoError(t, err)
		files[c.Name()] = string(b)
	}
	return label, files
}
