package imagecache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/permanent"
)

// choppyReader hands out src in reads of random sizes, as a socket does,
// then fails with end.
type choppyReader struct {
	src []byte
	r   *rand.Rand
	end error
}

func (c *choppyReader) Read(p []byte) (int, error) {
	if len(c.src) == 0 {
		return 0, c.end
	}
	n := min(len(p), len(c.src), 1+c.r.IntN(300<<10))
	copy(p, c.src[:n])
	c.src = c.src[n:]
	return n, nil
}

func choppy(src []byte, end error) *choppyReader {
	return &choppyReader{src: src, r: rand.New(rand.NewPCG(3, 4)), end: end}
}

// countWriter counts what passes it, like the progress writer.
type countWriter struct{ n int64 }

func (w *countWriter) Write(p []byte) (int, error) { w.n += int64(len(p)); return len(p), nil }

func openTestPartial(t *testing.T, sha string) (*Cache, *partial) {
	t.Helper()
	c := loopbackCache(t.TempDir())
	require.NoError(t, os.MkdirAll(c.dir, 0o755))
	p, err := c.openPartial(sha, "http://example.test/img")
	require.NoError(t, err)
	t.Cleanup(func() { p.f.Close() })
	return c, p
}

func readRecord(t *testing.T, c *Cache, sha string) resumeRecord {
	t.Helper()
	data, err := os.ReadFile(c.resumePath(sha))
	require.NoError(t, err)
	var rec resumeRecord
	require.NoError(t, json.Unmarshal(data, &rec))
	return rec
}

// requireRecordTrue checks that a resume record describes the file: its
// hash state, carried over the rest of body, gives body's digest, and the
// file holds body up to where the record says it is synced.
func requireRecordTrue(t *testing.T, c *Cache, sha string, body []byte) resumeRecord {
	t.Helper()
	rec := readRecord(t, c, sha)
	require.Positive(t, rec.Synced)
	h := sha256.New()
	require.NoError(t, h.(encoding.BinaryUnmarshaler).UnmarshalBinary(rec.Hash))
	h.Write(body[rec.Synced:])
	assert.Equal(t, digest(body), hex.EncodeToString(h.Sum(nil)), "the recorded hash state is of exactly the first %d bytes", rec.Synced)
	onDisk, err := os.ReadFile(c.partPath(sha))
	require.NoError(t, err)
	require.GreaterOrEqual(t, int64(len(onDisk)), rec.Synced)
	assert.True(t, bytes.Equal(body[:rec.Synced], onDisk[:rec.Synced]))
	return rec
}

// The hash and the file run on separate goroutines; when pump returns they
// describe the same bytes, and every checkpoint it made recorded the hash
// state of exactly the bytes synced.
func TestPumpWritesAndHashesEveryByteOnce(t *testing.T) {
	// Zero blocks become holes, the last ones too.
	body := append(testImage(9<<20+12345), make([]byte, 1<<20+5)...)
	sha := digest(body)
	c, p := openTestPartial(t, sha)
	p.every = 2 << 20 // several checkpoints mid-stream
	var progress countWriter
	require.NoError(t, p.pump(choppy(body, io.EOF), func() {}, &progress))

	assert.Equal(t, int64(len(body)), p.n)
	assert.Equal(t, sha, p.sum())
	assert.Equal(t, int64(len(body)), progress.n)
	got, err := os.ReadFile(c.partPath(sha))
	require.NoError(t, err)
	require.Equal(t, len(body), len(got))
	assert.True(t, bytes.Equal(body, got))
	assert.Less(t, allocatedBytes(t, c.partPath(sha)), int64(len(body))*8/10, "zero blocks are holes")
	rec := requireRecordTrue(t, c, sha, body)
	assert.Less(t, rec.Synced, int64(len(body)), "the last checkpoint was mid-stream")
}

// A download cut short keeps what came, with the hash over exactly that,
// so a resume can carry on from it.
func TestPumpCutShortKeepsFileAndHashTogether(t *testing.T) {
	body := testImage(6 << 20)
	sha := digest(body)
	c, p := openTestPartial(t, sha)
	p.every = 1 << 20
	cutAt := 3<<20 + 777
	err := p.pump(choppy(body[:cutAt], io.ErrUnexpectedEOF), func() {}, nil)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	_, local := errors.AsType[*localError](err)
	assert.False(t, local, "a failed read is the server's, not this host's")

	assert.Equal(t, int64(cutAt), p.n)
	assert.Equal(t, digest(body[:cutAt]), p.sum())
	p.keep()
	rec := requireRecordTrue(t, c, sha, body)
	assert.Equal(t, int64(cutAt), rec.Synced)
}

// endlessReader yields data until aborted, then fails; without the abort
// pump would wait on it forever.
type endlessReader struct{ aborted chan struct{} }

func (r *endlessReader) Read(p []byte) (int, error) {
	select {
	case <-r.aborted:
		return 0, errors.New("aborted")
	default:
		return len(p), nil
	}
}

// A failed write stops the reader and the hasher, and what is left is
// never recorded: the hash may have gone past what the file holds.
func TestPumpWriteFailureStopsEverythingAndIsNeverRecorded(t *testing.T) {
	c, p := openTestPartial(t, strings.Repeat("ab", 32))
	ro, err := os.Open(p.f.Name()) // writes to it fail, like a full disk
	require.NoError(t, err)
	p.f.Close()
	p.f = ro

	r := &endlessReader{aborted: make(chan struct{})}
	done := make(chan error, 1)
	go func() { done <- p.pump(r, func() { close(r.aborted) }, nil) }()
	select {
	case err = <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("pump did not return after its write failed")
	}
	_, local := errors.AsType[*localError](err)
	assert.True(t, local, "a failed write is this host's: %v", err)
	assert.True(t, p.broken)
	require.Error(t, p.checkpoint(), "a broken partial is never recorded")
	_, err = os.Stat(c.resumePath(p.sha))
	assert.ErrorIs(t, err, os.ErrNotExist)
}

// A download of many pipeline buffers whose digest does not match is
// refused and leaves nothing, usable or not.
func TestEnsureMismatchOverManyBuffersLeavesNothing(t *testing.T) {
	body := testImage(5<<20 + 3)
	ts, _ := serve(t, body)
	other := bytes.Clone(body)
	other[len(other)-1] ^= 1 // differs in the last byte only
	want := digest(other)
	dir := t.TempDir()
	c := loopbackCache(dir)
	_, err := c.Ensure(context.Background(), ts.URL+"/img", want, nil)
	require.ErrorIs(t, err, ErrChecksumMismatch)
	assert.True(t, permanent.Is(err))
	assert.Contains(t, err.Error(), "got "+digest(body))
	assert.Empty(t, dirNames(t, dir))
	_, err = os.Stat(c.Path(want))
	assert.ErrorIs(t, err, os.ErrNotExist)
}

// A download whose connection drops is never usable: nothing is placed, and
// what came is kept, recorded truly, for the next Ensure to finish.
func TestEnsureTruncatedDownloadIsNotUsableAndResumes(t *testing.T) {
	body := testImage(6<<20 + 99)
	sum := digest(body)
	srv := newRangeServer(t, body, `"v1"`)
	cutAt := 3<<20 + 5
	srv.cut = cutFirst(cutAt)
	dir := t.TempDir()
	// The floor is above what the cut request moves, so the first Ensure
	// gives up instead of asking for the rest at once.
	c := loopbackCache(dir, WithMinProgress(1<<30))
	_, err := c.Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.Error(t, err)
	assert.False(t, permanent.Is(err))
	assert.Contains(t, err.Error(), "body after")
	_, err = os.Stat(c.Path(sum))
	assert.ErrorIs(t, err, os.ErrNotExist)
	assert.ElementsMatch(t, []string{sum + ".download.part", sum + ".download.resume"}, dirNames(t, dir))
	rec := requireRecordTrue(t, c, sum, body)
	assert.Equal(t, int64(cutAt), rec.Synced)

	p, err := loopbackCache(dir).Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(body, readFile(t, p)))
	assert.Equal(t, filepath.Join(dir, sum+".raw"), p)
}

// A checkpoint that cannot be made durable ends the download as this
// host's failure, even though its fsync ran beside the writer.
func TestPumpCheckpointFailureEndsTheDownload(t *testing.T) {
	orig := fsync
	fsync = func(f *os.File) error {
		if strings.HasSuffix(f.Name(), ".download.part") {
			return errors.New("input/output error")
		}
		return orig(f)
	}
	t.Cleanup(func() { fsync = orig })

	body := testImage(6 << 20)
	c, p := openTestPartial(t, digest(body))
	p.every = 1 << 20
	err := p.pump(choppy(body, io.EOF), func() {}, nil)
	_, local := errors.AsType[*localError](err)
	require.True(t, local, "a failed sync is this host's: %v", err)
	assert.ErrorContains(t, err, "input/output error")
	_, err = os.Stat(c.resumePath(p.sha))
	assert.ErrorIs(t, err, os.ErrNotExist, "nothing was recorded")
}

// closeAtWriter closes reached once n bytes have passed it.
type closeAtWriter struct {
	n, at   int64
	reached chan struct{}
}

func (w *closeAtWriter) Write(p []byte) (int, error) {
	w.n += int64(len(p))
	if w.n >= w.at && w.n-int64(len(p)) < w.at {
		close(w.reached)
	}
	return len(p), nil
}

// A checkpoint's sync never holds up the writer: marks that come while it
// runs wait for it (the latest one is kept), and the bytes go on to disk.
// Here the first checkpoint's sync cannot end before every byte has been
// written, which a writer that waited for it at the next mark never does.
func TestPumpWritesOnWhileACheckpointSyncs(t *testing.T) {
	body := testImage(8 << 20)
	progress := &closeAtWriter{at: int64(len(body)), reached: make(chan struct{})}
	var waited atomic.Bool
	var first sync.Once
	orig := fsync
	fsync = func(f *os.File) error {
		if strings.HasSuffix(f.Name(), ".download.part") {
			first.Do(func() {
				select {
				case <-progress.reached:
				case <-time.After(10 * time.Second):
					waited.Store(true)
				}
			})
		}
		return orig(f)
	}
	t.Cleanup(func() { fsync = orig })

	c, p := openTestPartial(t, digest(body))
	p.every = 1 << 20 // a mark every MiB: several come during the first sync
	require.NoError(t, p.pump(choppy(body, io.EOF), func() {}, progress))
	assert.False(t, waited.Load(), "the writer stopped at a mark until the sync before it ended")
	assert.Equal(t, int64(len(body)), progress.n)
	assert.Equal(t, digest(body), p.sum())
	rec := requireRecordTrue(t, c, p.sha, body)
	assert.GreaterOrEqual(t, rec.Synced, int64(1<<20), "the first mark was recorded")
}
