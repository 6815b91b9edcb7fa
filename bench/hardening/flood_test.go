package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// eitriBin is the binary under test: EITRI_BIN (make test sets it), or one
// built from this tree.
func eitriBin(t *testing.T) string {
	t.Helper()
	if bin := os.Getenv("EITRI_BIN"); bin != "" {
		return bin
	}
	bin, err := buildEitri(t.TempDir())
	require.NoError(t, err)
	return bin
}

// Anyone who can reach the control plane can send it a body, so an
// unauthenticated one must cost next to nothing: 100 clients post 1 MiB gzip
// bombs (each 1 GiB inflated) to every kind of route for 5 s, and the
// control plane's memory stays within a few tens of MiB of idle (one bomb
// inflated would take it from about 29 MiB to over 2 GiB). A safety bound,
// not a speed goal: loose on purpose.
func TestFloodOf100UnauthenticatedGzipBombsKeepsRSSFlat(t *testing.T) {
	if testing.Short() {
		t.Skip("floods for 5 s")
	}
	srv, err := start(context.Background(), eitriBin(t), t.TempDir(), t.Output())
	require.NoError(t, err)
	defer srv.stop()
	res, err := flood(context.Background(), srv, 100, 1<<20, 5*time.Second, "both")
	require.NoError(t, err)
	t.Log(res)
	assert.Greater(t, res.requests, int64(100), "the flood got through to the server")
	assert.Zero(t, res.failed, "every bomb is answered, none hangs or resets")
	for k := range res.answers {
		assert.NotContains(t, k, " 200 ", "nothing is accepted: %s", k)
	}
	assert.Less(t, res.growth(), int64(64<<20), "RSS growth under the flood: %s", res)
}

// What the server prints is read by more people than the admin (whoever
// watches its terminal, a journal, a CI log), so the first admin's token goes
// to its file only, and the log says where it is and how to use it.
func TestFirstStartLogsWhereTheAdminTokenIsNotTheToken(t *testing.T) {
	dir := t.TempDir()
	srv, err := start(context.Background(), eitriBin(t), dir, t.Output())
	require.NoError(t, err)
	srv.stop()
	path := filepath.Join(dir, "admin.token")
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	token := strings.TrimSpace(string(b))
	require.True(t, strings.HasPrefix(token, "eitri_pat_"))
	out := srv.out.String()
	assert.NotContains(t, out, token, "the token is not in the output")
	assert.NotContains(t, out, token[len("eitri_pat_"):], "not even without its prefix")
	assert.Contains(t, out, "export EITRI_TOKEN=$(cat "+path+")", "it says how to read the file")
}
