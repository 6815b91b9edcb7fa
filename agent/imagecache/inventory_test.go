package imagecache

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// cached puts body in c through a real download and returns its digest.
func cached(t *testing.T, c *Cache, body []byte) string {
	t.Helper()
	ts, sum := serve(t, body)
	_, err := c.Ensure(context.Background(), ts.URL+"/img", sum, nil)
	require.NoError(t, err)
	return sum
}

func shas(ims []Image) []string {
	out := make([]string, len(ims))
	for i, im := range ims {
		out[i] = im.SHA256
	}
	return out
}

func TestPruneRemovesOnlyWhatNothingWants(t *testing.T) {
	dir := t.TempDir()
	c := loopbackCache(dir)
	pulled := cached(t, c, testImage(64<<10))
	c.Acquire(pulled) // a pull holds it
	forVM := cached(t, c, testImage(96 << 10)[1:])
	unused := cached(t, c, testImage(80 << 10)[2:])
	unusedBytes := allocatedBytes(t, c.Path(unused))

	var asked []string
	removed, err := c.Prune(context.Background(), func(sha string) bool {
		asked = append(asked, sha)
		return sha == forVM
	})
	require.NoError(t, err)
	require.Equal(t, []string{unused}, shas(removed))
	assert.Equal(t, unusedBytes, removed[0].Bytes, "the space it took is the space given back")
	assert.NotContains(t, asked, pulled, "a pinned image is kept without asking")

	assert.NoFileExists(t, c.Path(unused))
	assert.NoFileExists(t, filepath.Join(dir, unused+".verified"), "its record goes with it")
	assert.FileExists(t, c.Path(pulled))
	assert.FileExists(t, c.Path(forVM))

	// Once its pull lets go, the pulled image is no longer wanted either.
	c.Release(pulled)
	removed, err = c.Prune(context.Background(), func(sha string) bool { return sha == forVM })
	require.NoError(t, err)
	assert.Equal(t, []string{pulled}, shas(removed))
	assert.FileExists(t, c.Path(forVM))
}

func TestPruneKeepsAVMsBaseThatHasNoHardLinkOfItsOwn(t *testing.T) {
	// The overlay names the cache's file itself (cache on another
	// filesystem): after an agent restart no pin protects it, only the
	// VM's record does.
	c := loopbackCache(t.TempDir())
	base := cached(t, c, testImage(32<<10))
	removed, err := c.Prune(context.Background(), func(sha string) bool { return sha == base })
	require.NoError(t, err)
	assert.Empty(t, removed)
	assert.FileExists(t, c.Path(base))

	// A fresh cache over the same directory (a restarted agent) keeps it too.
	c2 := loopbackCache(c.Dir())
	removed, err = c2.Prune(context.Background(), func(sha string) bool { return sha == base })
	require.NoError(t, err)
	assert.Empty(t, removed)
}

func TestAPrunedImageIsFetchedAgainWhenWanted(t *testing.T) {
	c := loopbackCache(t.TempDir())
	body := testImage(16 << 10)
	ts, sum := serve(t, body)
	_, err := c.Ensure(context.Background(), ts.URL+"/img", sum, nil)
	require.NoError(t, err)
	_, err = c.Prune(context.Background(), func(string) bool { return false })
	require.NoError(t, err)
	p, err := c.Ensure(context.Background(), ts.URL+"/img", sum, nil)
	require.NoError(t, err)
	assert.FileExists(t, p)
	assert.Equal(t, int64(2), ts.hits.Load())
}

func TestImagesListsTheCacheNewestUseFirstWithItsPins(t *testing.T) {
	c := loopbackCache(t.TempDir())
	ims, err := c.Images()
	require.NoError(t, err)
	assert.Empty(t, ims, "a cache never used lists nothing")

	older := cached(t, c, testImage(8<<10))
	newer := cached(t, c, testImage(9<<10))
	old := time.Now().Add(-time.Hour)
	require.NoError(t, os.Chtimes(c.Path(older), old, old))
	c.Acquire(older)
	defer c.Release(older)

	ims, err = c.Images()
	require.NoError(t, err)
	require.Equal(t, []string{newer, older}, shas(ims))
	assert.False(t, ims[0].Pinned)
	assert.True(t, ims[1].Pinned)
	assert.WithinDuration(t, old, ims[1].LastUsed, time.Second)
	assert.Positive(t, ims[0].Bytes)
}

func TestChangedSignalsWhatAReportWouldShow(t *testing.T) {
	c := loopbackCache(t.TempDir())
	drain := func() bool {
		select {
		case <-c.Changed():
			return true
		default:
			return false
		}
	}
	sum := cached(t, c, testImage(8<<10))
	assert.True(t, drain(), "an image placed")
	assert.False(t, drain(), "coalesced: one signal, read once")
	c.Acquire(sum)
	assert.True(t, drain(), "pinned")
	c.Acquire(sum)
	assert.False(t, drain(), "a second pin changes nothing shown")
	c.Release(sum)
	assert.False(t, drain())
	c.Release(sum)
	assert.True(t, drain(), "unpinned")
	_, err := c.Prune(context.Background(), func(string) bool { return false })
	require.NoError(t, err)
	assert.True(t, drain(), "pruned")
	_, err = c.Prune(context.Background(), func(string) bool { return false })
	require.NoError(t, err)
	assert.False(t, drain(), "a prune that removed nothing")
}

// Holds is what the engine asks before a create's image step says what it
// does: true only for a finished image, never while it is being fetched,
// and false again once it is gone.
func TestHoldsOnlyAFinishedImage(t *testing.T) {
	body := testImage(256 << 10)
	sum := digest(body)
	ts, open, _ := gatedServer(t, body)
	c := loopbackCache(t.TempDir())

	assert.False(t, c.Holds(sum), "nothing fetched yet")
	assert.False(t, c.Holds("../../etc/passwd"), "not a digest")
	done := make(chan error, 1)
	go func() {
		_, err := c.Ensure(context.Background(), ts.URL, sum, nil)
		done <- err
	}()
	require.Eventually(t, func() bool { return waiters(c, sum) == 1 }, 5*time.Second, time.Millisecond)
	assert.False(t, c.Holds(sum), "a download under way is not held")
	close(open)
	require.NoError(t, <-done)
	assert.True(t, c.Holds(sum))

	_, err := c.Prune(context.Background(), func(string) bool { return false })
	require.NoError(t, err)
	assert.False(t, c.Holds(sum), "pruned")
}
