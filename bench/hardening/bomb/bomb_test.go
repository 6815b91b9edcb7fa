package bomb

import (
	"bytes"
	"compress/gzip"
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestGzipInflatesToWhatItSays(t *testing.T) {
	b, n := Gzip(64 << 10)
	assert.LessOrEqual(t, len(b), 64<<10)
	assert.Greater(t, n, int64(50<<20), "about a thousandfold")
	zr, err := gzip.NewReader(bytes.NewReader(b))
	require.NoError(t, err)
	got, err := io.Copy(io.Discard, zr)
	require.NoError(t, err, "a valid stream, checksum and size included")
	assert.Equal(t, n, got)
}
