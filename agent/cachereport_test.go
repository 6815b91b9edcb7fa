package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/state"
)

// cacheWith is a real cache holding one image per body, downloaded from a
// loopback server; it returns their digests in order.
func cacheWith(t *testing.T, bodies ...[]byte) (*imagecache.Cache, []string) {
	t.Helper()
	c := imagecache.New(t.TempDir(), imagecache.WithDialPolicy(imagecache.AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}))
	var shas []string
	for _, b := range bodies {
		ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(b) }))
		sum := sha256.Sum256(b)
		sha := hex.EncodeToString(sum[:])
		_, err := c.Ensure(context.Background(), ts.URL+"/img", sha, nil)
		ts.Close()
		require.NoError(t, err)
		shas = append(shas, sha)
	}
	return c, shas
}

func body(n int, fill byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = fill + byte(i%7)
	}
	return b
}

func TestTheCacheReportNamesTheVMsAndThePruneKeepsTheirImagesAndThePinned(t *testing.T) {
	st := openState(t)
	c, shas := cacheWith(t, body(40<<10, 1), body(50<<10, 2), body(60<<10, 3))
	pulled, forVM, unused := shas[0], shas[1], shas[2]
	c.Acquire(pulled)
	defer c.Release(pulled)
	require.NoError(t, st.SaveVM("vm-1", state.Record{Spec: state.VMSpec{ID: "vm-1", ImageSHA256: forVM}}))
	r := CacheReport{Cache: c, State: st, Log: slog.Default()}

	rep := r.Report()
	require.Len(t, rep.Images, 3)
	rows := map[string][]string{}
	var total uint64
	for _, im := range rep.Images {
		rows[im.Sha256] = im.VmIds
		total += im.SizeBytes
		assert.Equal(t, im.Sha256 == pulled, im.Pinned, im.Sha256)
	}
	assert.Equal(t, []string{"vm-1"}, rows[forVM])
	assert.Equal(t, total, rep.TotalBytes)
	assert.Zero(t, rep.More)

	pruned, err := r.Prune(context.Background())
	require.NoError(t, err)
	require.Len(t, pruned.Removed, 1)
	assert.Equal(t, unused, pruned.Removed[0].Sha256)
	assert.Equal(t, pruned.Removed[0].SizeBytes, pruned.FreedBytes)
	assert.Positive(t, pruned.FreedBytes)
	assert.NoFileExists(t, c.Path(unused))
	assert.FileExists(t, c.Path(pulled))
	assert.FileExists(t, c.Path(forVM))
}

func TestAPruneIsRefusedWhileAVMRecordCannotBeRead(t *testing.T) {
	st := openState(t)
	c, shas := cacheWith(t, body(20<<10, 4))
	// A torn record may be the VM whose base this is.
	require.NoError(t, os.WriteFile(filepath.Join(st.Dir(), "vms", "vm-2.json"), []byte("{"), 0o600))
	r := CacheReport{Cache: c, State: st, Log: slog.Default()}
	_, err := r.Prune(context.Background())
	require.ErrorContains(t, err, "prune refused")
	assert.FileExists(t, c.Path(shas[0]))
}
