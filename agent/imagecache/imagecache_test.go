package imagecache

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/klauspost/compress/gzip"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/permanent"
)

func digest(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// server serves body on every path, counting requests. With declare set it
// sends Content-Length; otherwise the response is chunked.
type server struct {
	*httptest.Server
	hits atomic.Int64
}

func serveBody(t *testing.T, body []byte, declare bool) (*server, string) {
	t.Helper()
	s := &server{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.hits.Add(1)
		if declare {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		}
		w.Write(body)
	}))
	t.Cleanup(s.Close)
	return s, digest(body)
}

func serve(t *testing.T, body []byte) (*server, string) { return serveBody(t, body, true) }

// testImage is a raw disk with a recognisable pattern: random data, a long
// zero stretch (becomes a hole), text, and a length that is not a multiple
// of the cluster size.
func testImage(size int) []byte {
	b := make([]byte, size)
	r := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < size/3; i += 8 {
		v := r.Uint64()
		for k := 0; k < 8 && i+k < size; k++ {
			b[i+k] = byte(v >> (8 * k))
		}
	}
	text := []byte("eitri boots a tiny guest; ")
	for i := 2 * size / 3; i < size; i += len(text) {
		copy(b[i:], text)
	}
	return b
}

func gz(t *testing.T, b []byte) []byte {
	var buf bytes.Buffer
	w := gzip.NewWriter(&buf)
	_, err := w.Write(b)
	require.NoError(t, err)
	require.NoError(t, w.Close())
	return buf.Bytes()
}

func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	require.NoError(t, err)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names
}

func allocatedBytes(t *testing.T, p string) int64 {
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(p, &st))
	return st.Blocks * 512
}

func TestEnsureFormats(t *testing.T) {
	raw := testImage(1<<20 + 12345) // 3 zero regions' worth of holes, ragged end
	small := testImage(70_000)
	cases := []struct {
		name   string
		body   []byte
		want   []byte
		sparse bool // the zero third must come out as a hole
	}{
		{"raw", raw, raw, true},
		{"raw ending in zeros", append(bytes.Clone(raw), make([]byte, 1<<20+5)...), append(bytes.Clone(raw), make([]byte, 1<<20+5)...), true},
		{"gzip raw", gz(t, raw), raw, true},
		{"qcow2 v3 uncompressed", encodeQcow2(t, raw, encOpts{}), raw, true},
		{"qcow2 v2 uncompressed", encodeQcow2(t, raw, encOpts{version: 2}), raw, true},
		{"qcow2 v3 zlib", encodeQcow2(t, raw, encOpts{compress: "zlib"}), raw, true},
		{"qcow2 v2 zlib", encodeQcow2(t, raw, encOpts{version: 2, compress: "zlib"}), raw, true},
		{"qcow2 v3 zstd", encodeQcow2(t, raw, encOpts{compress: "zstd"}), raw, true},
		{"qcow2 zero-flag clusters", encodeQcow2(t, raw, encOpts{zeroFlag: true, compress: "zlib"}), raw, true},
		{"qcow2 512-byte clusters", encodeQcow2(t, small, encOpts{clusterBits: 9, compress: "zlib"}), small, false},
		{"qcow2 2 MiB clusters", encodeQcow2(t, small, encOpts{clusterBits: 21}), small, false},
		{"qcow2 last stream ends at EOF", encodeQcow2(t, small, encOpts{compress: "zstd", trimTail: 1}), small, false},
		{"qcow2 empty", encodeQcow2(t, make([]byte, 4<<20), encOpts{}), make([]byte, 4<<20), true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ts, sum := serve(t, tc.body)
			dir := t.TempDir()
			c := loopbackCache(dir)
			p, err := c.Ensure(context.Background(), ts.URL+"/img", sum, nil)
			require.NoError(t, err)
			assert.Equal(t, filepath.Join(dir, sum+".raw"), p)
			got, err := os.ReadFile(p)
			require.NoError(t, err)
			require.Equal(t, len(tc.want), len(got), "raw image is truncated to the virtual size")
			require.True(t, bytes.Equal(tc.want, got), "decoded bytes differ")
			if tc.sparse {
				assert.Less(t, allocatedBytes(t, p), int64(len(tc.want))*9/10, "zero regions must be holes")
			}
			assert.Equal(t, []string{sum + ".raw", sum + ".verified"}, dirNames(t, dir), "nothing but the image and its record is left")
		})
	}
}

// qemuImg makes qcow2 fixtures with the real tool, so the decoder is held to
// what QEMU actually writes.
func qemuImg(t testing.TB, raw []byte, args ...string) []byte {
	t.Helper()
	bin, err := exec.LookPath("qemu-img")
	if err != nil {
		t.Skip("qemu-img not installed (apt-get install qemu-utils); the built-in encoder tests still cover the decoder")
	}
	dir := t.TempDir()
	in, out := filepath.Join(dir, "in.raw"), filepath.Join(dir, "out.qcow2")
	require.NoError(t, os.WriteFile(in, raw, 0o644))
	cmd := exec.Command(bin, append(append([]string{"convert", "-f", "raw", "-O", "qcow2"}, args...), in, out)...)
	b, err := cmd.CombinedOutput()
	require.NoError(t, err, "qemu-img: %s", b)
	img, err := os.ReadFile(out)
	require.NoError(t, err)
	return img
}

func TestEnsureQemuImgFixtures(t *testing.T) {
	raw := testImage(3<<20 + 4096 + 512) // qemu-img rounds sizes to sectors
	cases := []struct {
		name string
		args []string
	}{
		{"uncompressed", nil},
		{"zlib", []string{"-c"}},
		{"zstd", []string{"-c", "-o", "compression_type=zstd"}},
		{"v2 zlib", []string{"-c", "-o", "compat=0.10"}},
		{"zlib 4k clusters", []string{"-c", "-o", "cluster_size=4096"}},
		{"uncompressed 2M clusters", []string{"-o", "cluster_size=2M"}},
		{"uncompressed, metadata preallocated", []string{"-o", "preallocation=metadata"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			img := qemuImg(t, raw, tc.args...)
			ts, sum := serve(t, img)
			dir := t.TempDir()
			p, err := loopbackCache(dir).Ensure(context.Background(), ts.URL+"/img.qcow2", sum, nil)
			require.NoError(t, err)
			got, err := os.ReadFile(p)
			require.NoError(t, err)
			require.Equal(t, len(raw), len(got))
			require.True(t, bytes.Equal(raw, got), "decoded bytes differ from what qemu-img was given")
			assert.Less(t, allocatedBytes(t, p), int64(len(raw))*9/10, "the zero third must be a hole")
			assert.Len(t, dirNames(t, dir), 2, "the image and its record")
		})
	}
}

func TestEnsureRefusesPermanently(t *testing.T) {
	raw := testImage(200_000)
	qcowZlib := encodeQcow2(t, raw, encOpts{compress: "zlib"})
	cases := []struct {
		name string
		body func(t *testing.T) []byte
		want string
		is   error
	}{
		{"backing file", func(t *testing.T) []byte { return encodeQcow2(t, raw, encOpts{backing: "base.qcow2"}) },
			`backing file "base.qcow2"`, ErrUnsupported},
		{"backing file from qemu-img", func(t *testing.T) []byte {
			bin, err := exec.LookPath("qemu-img")
			if err != nil {
				t.Skip("qemu-img not installed (apt-get install qemu-utils)")
			}
			dir := t.TempDir()
			base, over := filepath.Join(dir, "base.qcow2"), filepath.Join(dir, "over.qcow2")
			out, err := exec.Command(bin, "create", "-f", "qcow2", base, "1M").CombinedOutput()
			require.NoError(t, err, "%s", out)
			out, err = exec.Command(bin, "create", "-f", "qcow2", "-b", base, "-F", "qcow2", over).CombinedOutput()
			require.NoError(t, err, "%s", out)
			b, err := os.ReadFile(over)
			require.NoError(t, err)
			return b
		}, "backing file", ErrUnsupported},
		{"encrypted", func(t *testing.T) []byte { return encodeQcow2(t, raw, encOpts{crypt: 2}) },
			"encrypted", ErrUnsupported},
		{"gzip wrapping qcow2", func(t *testing.T) []byte { return gz(t, qcowZlib) },
			"gzip wraps a qcow2", ErrUnsupported},
		{"corrupt gzip", func(t *testing.T) []byte { return []byte("\x1f\x8bgarbage, not deflate") },
			"gzip", ErrCorrupt},
		{"truncated gzip", func(t *testing.T) []byte { g := gz(t, raw); return g[:len(g)/2] },
			"gzip", ErrCorrupt},
		{"truncated qcow2 header", func(t *testing.T) []byte { return qcowZlib[:40] },
			"header truncated", ErrCorrupt},
		{"qcow2 version 4", func(t *testing.T) []byte {
			b := bytes.Clone(qcowZlib)
			b[7] = 4
			return b
		}, "version 4", ErrUnsupported},
		{"qcow2 L1 outside file", func(t *testing.T) []byte {
			b := bytes.Clone(qcowZlib)
			b[40] = 0x7f
			return b
		}, "L1 table", ErrCorrupt},
		{"qcow2 garbled zlib cluster", func(t *testing.T) []byte { return encodeQcow2(t, raw, encOpts{compress: "zlib", corruptData: true}) },
			"zlib", ErrCorrupt},
		{"qcow2 garbled zstd cluster", func(t *testing.T) []byte { return encodeQcow2(t, raw, encOpts{compress: "zstd", corruptData: true}) },
			"zstd", ErrCorrupt},
		// Clusters are inflated while the table is still being read, so
		// the cut is met either as a cluster past the end of the file or
		// as a stream ending early, whichever comes first: both say qcow2
		// and both are corrupt.
		{"qcow2 cut short", func(t *testing.T) []byte { return qcowZlib[:len(qcowZlib)-20000] },
			"corrupt image: qcow2:", ErrCorrupt},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ts, sum := serve(t, tc.body(t))
			dir := t.TempDir()
			_, err := loopbackCache(dir).Ensure(context.Background(), ts.URL+"/img", sum, nil)
			require.Error(t, err)
			var p interface{ Permanent() bool }
			require.ErrorAs(t, err, &p)
			assert.True(t, p.Permanent())
			assert.ErrorIs(t, err, tc.is)
			assert.Contains(t, err.Error(), tc.want)
			assert.Empty(t, dirNames(t, dir), "a refused image leaves nothing")
		})
	}
}

func TestEnsureChecksumMismatchLeavesNothing(t *testing.T) {
	ts, _ := serve(t, []byte("tampered bytes"))
	want := strings.Repeat("0", 64)
	dir := t.TempDir()
	_, err := loopbackCache(dir).Ensure(context.Background(), ts.URL+"/img", want, nil)
	require.Error(t, err)
	assert.True(t, permanent.Is(err))
	assert.ErrorIs(t, err, ErrChecksumMismatch)
	assert.Contains(t, err.Error(), "image sha256 mismatch: want "+want+", got "+digest([]byte("tampered bytes")))
	assert.Empty(t, dirNames(t, dir))
}

func TestEnsureRejectsInvalidDigestBeforeTouchingAnything(t *testing.T) {
	ts, _ := serve(t, []byte("x"))
	dir := filepath.Join(t.TempDir(), "cache") // must never be created
	c := loopbackCache(dir)
	for name, sha := range map[string]string{
		"uppercase":      strings.Repeat("A", 64),
		"too short":      "abc123",
		"too long":       strings.Repeat("a", 65),
		"non-hex":        strings.Repeat("g", 64),
		"path traversal": "../../etc/passwd" + strings.Repeat("a", 48),
		"empty":          "",
	} {
		t.Run(name, func(t *testing.T) {
			_, err := c.Ensure(context.Background(), ts.URL, sha, nil)
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrInvalidDigest)
			assert.True(t, permanent.Is(err))
			assert.Contains(t, err.Error(), "invalid sha256")
		})
	}
	assert.Zero(t, ts.hits.Load(), "no request for a bad digest")
	assert.NoDirExists(t, dir, "no disk access for a bad digest")
}

func TestEnsureHTTPErrors(t *testing.T) {
	body := testImage(100_000)
	cases := []struct {
		name      string
		handler   http.HandlerFunc
		permanent bool
		want      string
	}{
		{"404", func(w http.ResponseWriter, r *http.Request) { http.NotFound(w, r) }, true, ": 404 Not Found"},
		{"403", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(403) }, true, ": 403 Forbidden"},
		{"500", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(500) }, false, ": 500 Internal Server Error"},
		{"503", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(503) }, false, ": 503 Service Unavailable"},
		{"429", func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(429) }, false, ": 429 Too Many Requests"},
		{"truncated body", func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(len(body)))
			w.Write(body[:len(body)/2])
			// Returning with the body short makes the server close the
			// connection: the client sees an unexpected EOF.
		}, false, ": body after"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ts := httptest.NewServer(tc.handler)
			t.Cleanup(ts.Close)
			dir := t.TempDir()
			url := ts.URL + "/images/disk.qcow2"
			_, err := loopbackCache(dir).Ensure(context.Background(), url, digest(body), nil)
			require.Error(t, err)
			assert.Equal(t, tc.permanent, permanent.Is(err), "permanent? %v", err)
			assert.Contains(t, err.Error(), "GET "+url+tc.want)
			if tc.name == "truncated body" {
				sum := digest(body)
				assert.Equal(t, []string{sum + ".download.part", sum + ".download.resume"}, dirNames(t, dir),
					"the half that came is kept for a resume")
				return
			}
			assert.Empty(t, dirNames(t, dir))
		})
	}
}

func TestEnsureNetworkErrorIsNotPermanent(t *testing.T) {
	ts := httptest.NewServer(http.NotFoundHandler())
	url := ts.URL + "/img"
	ts.Close() // connection refused from here on
	_, err := loopbackCache(t.TempDir()).Ensure(context.Background(), url, digest([]byte("x")), nil)
	require.Error(t, err)
	assert.False(t, permanent.Is(err))
	assert.Contains(t, err.Error(), "GET "+url)
}

func TestEnsureStalledDownloadIsNotPermanent(t *testing.T) {
	body := testImage(10_000)
	release := make(chan struct{})
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Write(body[:100])
		w.(http.Flusher).Flush()
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(release); ts.Close() })
	dir := t.TempDir()
	_, err := loopbackCache(dir, WithStallTimeout(200*time.Millisecond)).Ensure(context.Background(), ts.URL+"/img", digest(body), nil)
	require.Error(t, err)
	assert.ErrorIs(t, err, errStalled)
	assert.False(t, permanent.Is(err))
	sum := digest(body)
	assert.Equal(t, []string{sum + ".download.part", sum + ".download.resume"}, dirNames(t, dir),
		"what came is kept for the retry to resume from")
}

func TestEnsureCacheHitDownloadsAndReportsNothing(t *testing.T) {
	body := testImage(64 << 10)
	ts, sum := serve(t, body)
	c := loopbackCache(t.TempDir(), WithProgressStep(1024))
	var first int
	p1, err := c.Ensure(context.Background(), ts.URL, sum, func(int64, int64) { first++ })
	require.NoError(t, err)
	assert.Positive(t, first)

	var calls int
	p2, err := c.Ensure(context.Background(), ts.URL, sum, func(int64, int64) { calls++ })
	require.NoError(t, err)
	assert.Equal(t, p1, p2)
	assert.Zero(t, calls, "a hit has no download to report on")
	assert.Equal(t, int64(1), ts.hits.Load())
}

func TestEnsureProgress(t *testing.T) {
	body := testImage(16 << 10)
	for _, declare := range []bool{true, false} {
		t.Run(fmt.Sprintf("content-length=%v", declare), func(t *testing.T) {
			ts, sum := serveBody(t, body, declare)
			// The interval is out of reach: this is about the step.
			c := loopbackCache(t.TempDir(), WithProgressStep(4<<10), WithProgressInterval(time.Hour))
			type report struct{ done, total int64 }
			var reports []report
			_, err := c.Ensure(context.Background(), ts.URL, sum, func(done, total int64) {
				reports = append(reports, report{done, total})
			})
			require.NoError(t, err)
			require.NotEmpty(t, reports)
			wantTotal := int64(-1)
			if declare {
				wantTotal = int64(len(body))
			}
			assert.Equal(t, report{0, wantTotal}, reports[0], "the answer is reported before any byte, total and all")
			assert.LessOrEqual(t, len(reports), 1+4, "then at most one report per step")
			last := len(reports) - 1
			assert.Equal(t, int64(len(body)), reports[last].done, "the last report is where the body ended")
			for i, r := range reports {
				assert.Equal(t, wantTotal, r.total)
				assert.LessOrEqual(t, r.done, int64(len(body)))
				if i > 0 && i < last {
					assert.GreaterOrEqual(t, r.done-reports[i-1].done, int64(4<<10), "reports are a step apart")
				}
			}
		})
	}
}

func TestProgressWriterThrottles(t *testing.T) {
	var calls []int64
	w := &progressWriter{total: 400, step: 100, report: func(done, _ int64) { calls = append(calls, done) }}
	for range 40 {
		_, err := w.Write(make([]byte, 10))
		require.NoError(t, err)
	}
	assert.Equal(t, []int64{100, 200, 300, 400}, calls)
}

// A body whose last bytes come after a report, and are fewer than a step,
// still ends on a report of the whole body: the server holds them back until
// the first half has been reported, so the download's last chunk is short.
func TestEnsureReportsWhereTheBodyEnded(t *testing.T) {
	const half = pipeBufSize / 2
	body := testImage(half + 10)
	reported := make(chan struct{})
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = w.Write(body[:half])
		w.(http.Flusher).Flush()
		select {
		case <-reported:
		case <-r.Context().Done():
			return
		}
		_, _ = w.Write(body[half:])
	}))
	t.Cleanup(ts.Close)
	c := loopbackCache(t.TempDir(), WithProgressStep(4<<10), WithProgressInterval(time.Hour))
	var dones []int64
	_, err := c.Ensure(context.Background(), ts.URL, digest(body), func(done, _ int64) {
		dones = append(dones, done)
		if done == half {
			close(reported)
		}
	})
	require.NoError(t, err)
	assert.Equal(t, []int64{0, half, half + 10}, dones)
}

// The body rarely ends on a step: flush says where it ended, once, and
// says nothing when the last step already did.
func TestProgressWriterFlushSaysWhereTheBodyEnded(t *testing.T) {
	cases := []struct {
		name   string
		writes []int
		want   []int64
	}{
		{"ends between steps", []int{100, 30}, []int64{100, 130}},
		{"ends on a step", []int{100, 100}, []int64{100, 200}},
		{"shorter than a step", []int{40}, []int64{40}},
		{"empty", nil, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var calls []int64
			w := &progressWriter{total: -1, step: 100, report: func(done, _ int64) { calls = append(calls, done) }}
			for _, n := range tc.writes {
				_, err := w.Write(make([]byte, n))
				require.NoError(t, err)
			}
			w.flush()
			w.flush()
			assert.Equal(t, tc.want, calls)
		})
	}
}

// A slow download is reported every interval even when no step has passed,
// but only when it moved; the clock is the test's, so nothing here is timed.
func TestProgressWriterReportsASlowDownloadEveryInterval(t *testing.T) {
	now := time.Unix(1000, 0)
	var calls []int64
	w := &progressWriter{total: -1, step: 1 << 30, every: time.Second, now: func() time.Time { return now },
		markedAt: now, report: func(done, _ int64) { calls = append(calls, done) }}
	write := func(n int) {
		_, err := w.Write(make([]byte, n))
		require.NoError(t, err)
	}
	write(10) // within the interval: nothing
	now = now.Add(999 * time.Millisecond)
	write(10)
	now = now.Add(time.Millisecond)
	write(10) // the interval has passed and it moved
	now = now.Add(5 * time.Second)
	write(0) // it has not moved since: nothing to say
	write(5)
	write(5) // just reported
	assert.Equal(t, []int64{30, 35}, calls)
}

// gatedServer holds every response until open is closed, so a test can line
// callers up behind one download.
func gatedServer(t *testing.T, body []byte) (*server, chan struct{}, chan struct{}) {
	open := make(chan struct{})
	aborted := make(chan struct{}, 16)
	s := &server{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.hits.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		w.Write(body[:1024])
		w.(http.Flusher).Flush()
		select {
		case <-open:
			w.Write(body[1024:])
		case <-r.Context().Done():
			aborted <- struct{}{}
		}
	}))
	t.Cleanup(s.Close)
	return s, open, aborted
}

func waiters(c *Cache, sha string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if f := c.flights[sha]; f != nil {
		return len(f.waiters)
	}
	return 0
}

func TestEnsureConcurrentCallersShareOneDownload(t *testing.T) {
	body := testImage(256 << 10)
	sum := digest(body)
	ts, open, _ := gatedServer(t, body)
	c := loopbackCache(t.TempDir(), WithProgressStep(512))

	const n = 8
	var wg sync.WaitGroup
	paths := make([]string, n)
	errs := make([]error, n)
	reports := make([]atomic.Int64, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			paths[i], errs[i] = c.Ensure(context.Background(), ts.URL, sum, func(int64, int64) { reports[i].Add(1) })
		}()
	}
	require.Eventually(t, func() bool { return waiters(c, sum) == n }, 5*time.Second, time.Millisecond)
	close(open)
	wg.Wait()

	reporters := 0
	for i := range n {
		require.NoError(t, errs[i])
		assert.Equal(t, paths[0], paths[i])
		if reports[i].Load() > 0 {
			reporters++
		}
	}
	assert.Equal(t, int64(1), ts.hits.Load(), "one download for all callers")
	assert.Equal(t, 1, reporters, "only the caller doing the work hears progress")
}

func TestEnsureWaiterCancelDoesNotCancelFetch(t *testing.T) {
	body := testImage(256 << 10)
	sum := digest(body)
	ts, open, aborted := gatedServer(t, body)
	dir := t.TempDir()
	c := loopbackCache(dir, WithProgressStep(1))

	// The leader starts the fetch, then gives up; a second caller stays.
	leaderCtx, cancelLeader := context.WithCancel(context.Background())
	var leaderGone atomic.Bool
	var lateReports atomic.Int64
	leaderErr := make(chan error, 1)
	go func() {
		_, err := c.Ensure(leaderCtx, ts.URL, sum, func(int64, int64) {
			if leaderGone.Load() {
				lateReports.Add(1)
			}
		})
		leaderErr <- err
	}()
	require.Eventually(t, func() bool { return ts.hits.Load() == 1 }, 5*time.Second, time.Millisecond)
	type result struct {
		path string
		err  error
	}
	other := make(chan result, 1)
	go func() {
		p, err := c.Ensure(context.Background(), ts.URL, sum, nil)
		other <- result{p, err}
	}()
	require.Eventually(t, func() bool { return waiters(c, sum) == 2 }, 5*time.Second, time.Millisecond)

	cancelLeader()
	require.ErrorIs(t, <-leaderErr, context.Canceled)
	leaderGone.Store(true)
	close(open)
	r := <-other
	require.NoError(t, r.err)
	got, err := os.ReadFile(r.path)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(body, got))
	assert.Equal(t, int64(1), ts.hits.Load())
	assert.Empty(t, aborted, "the fetch was not cancelled")
	assert.Zero(t, lateReports.Load(), "a caller that left hears nothing more")
}

func TestEnsureLastWaiterLeavingCancelsFetch(t *testing.T) {
	body := testImage(256 << 10)
	sum := digest(body)
	ts, open, aborted := gatedServer(t, body)
	defer close(open)
	dir := t.TempDir()
	c := loopbackCache(dir)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := c.Ensure(ctx, ts.URL, sum, nil)
		done <- err
	}()
	// Wait for the request to reach the server, so there is a download to cancel.
	require.Eventually(t, func() bool { return ts.hits.Load() == 1 }, 5*time.Second, time.Millisecond)
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	select {
	case <-aborted:
	case <-time.After(5 * time.Second):
		t.Fatal("the download was not cancelled once nobody waited")
	}
	require.Eventually(t, func() bool { return len(dirNames(t, dir)) == 0 }, 5*time.Second, 5*time.Millisecond,
		"the abandoned download leaves nothing")
}

func TestEnsureReplacesLeftoverPartial(t *testing.T) {
	raw := testImage(300_000)
	img := encodeQcow2(t, raw, encOpts{compress: "zlib"})
	ts, sum := serve(t, img)
	dir := t.TempDir()
	// What a crash mid-download and mid-decode leaves behind.
	for _, name := range []string{sum + ".1234.download.part", sum + ".5678.raw.part"} {
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte("corrupt partial"), 0o644))
	}
	p, err := loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
	require.NoError(t, err)
	got, err := os.ReadFile(p)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(raw, got))
	assert.Equal(t, []string{sum + ".raw", sum + ".verified"}, dirNames(t, dir))
}

func TestEnsureEvictsLeastRecentlyUsed(t *testing.T) {
	const size = 64 << 10
	imgs := make([][]byte, 4)
	shas := make([]string, 4)
	urls := make([]string, 4)
	for i := range imgs {
		imgs[i] = bytes.Repeat([]byte{byte(i + 1)}, size) // no zeros: fully allocated
		ts, sha := serve(t, imgs[i])
		shas[i], urls[i] = sha, ts.URL
	}
	dir := t.TempDir()
	c := loopbackCache(dir, WithMaxBytes(3*size))
	ctx := context.Background()
	for i := range 3 {
		_, err := c.Ensure(ctx, urls[i], shas[i], nil)
		require.NoError(t, err)
	}
	// Deterministic ages: 0 oldest, then 1, then 2.
	now := time.Now()
	for i := range 3 {
		ts := now.Add(time.Duration(i-3) * time.Hour)
		require.NoError(t, os.Chtimes(c.Path(shas[i]), ts, ts))
	}
	// A hit makes 0 the most recent; 1 is now the LRU.
	_, err := c.Ensure(ctx, urls[0], shas[0], nil)
	require.NoError(t, err)

	_, err = c.Ensure(ctx, urls[3], shas[3], nil)
	require.NoError(t, err)
	assert.FileExists(t, c.Path(shas[0]))
	assert.NoFileExists(t, c.Path(shas[1]), "least recently used goes first")
	assert.FileExists(t, c.Path(shas[2]))
	assert.FileExists(t, c.Path(shas[3]))
	usage, err := c.Usage()
	require.NoError(t, err)
	assert.LessOrEqual(t, usage, int64(3*size))
}

func TestEnsureNeverEvictsPinnedImages(t *testing.T) {
	const size = 64 << 10
	var shas, urls []string
	for i := range 3 {
		ts, sha := serve(t, bytes.Repeat([]byte{byte(i + 1)}, size))
		shas, urls = append(shas, sha), append(urls, ts.URL)
	}
	c := loopbackCache(t.TempDir(), WithMaxBytes(size+size/2))
	ctx := context.Background()

	c.Acquire(shas[0]) // pinned before Ensure, as callers should
	_, err := c.Ensure(ctx, urls[0], shas[0], nil)
	require.NoError(t, err)
	_, err = c.Ensure(ctx, urls[1], shas[1], nil)
	require.NoError(t, err)
	assert.FileExists(t, c.Path(shas[0]), "a pinned image stays, even over the cap")
	assert.FileExists(t, c.Path(shas[1]), "the image just made stays")

	c.Release(shas[0])
	_, err = c.Ensure(ctx, urls[2], shas[2], nil)
	require.NoError(t, err)
	assert.NoFileExists(t, c.Path(shas[0]), "released, it may go")
	assert.NoFileExists(t, c.Path(shas[1]))
	assert.FileExists(t, c.Path(shas[2]))
}

func TestEnsureImageLargerThanCap(t *testing.T) {
	body := bytes.Repeat([]byte{7}, 1<<20)
	qcow := encodeQcow2(t, body, encOpts{compress: "zlib"}) // small download, big raw
	cases := []struct {
		name    string
		body    []byte
		declare bool
		cap     int64
	}{
		{"declared length", body, true, 512 << 10},
		{"chunked", body, false, 512 << 10},
		{"decoded qcow2", qcow, true, int64(len(qcow)) + 4096},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ts, sum := serveBody(t, tc.body, tc.declare)
			dir := t.TempDir()
			_, err := loopbackCache(dir, WithMaxBytes(tc.cap)).Ensure(context.Background(), ts.URL, sum, nil)
			require.Error(t, err)
			assert.ErrorIs(t, err, ErrTooLarge)
			assert.True(t, permanent.Is(err))
			assert.Contains(t, err.Error(), "cap")
			assert.Empty(t, dirNames(t, dir))
		})
	}
}

func TestEnsureRejectsNonHTTPURL(t *testing.T) {
	dir := t.TempDir()
	_, err := loopbackCache(dir).Ensure(context.Background(), "file:///etc/passwd", digest([]byte("x")), nil)
	require.Error(t, err)
	assert.True(t, permanent.Is(err))
	assert.Contains(t, err.Error(), "scheme")
}

// TestCancellingATrickledDownloadStopsItAndLeavesNothing: a server that
// sends one byte at a time holds a download open indefinitely; when its only
// caller gives up, Ensure returns once the connection is dropped and the
// work file removed, not merely once it has stopped waiting.
func TestCancellingATrickledDownloadStopsItAndLeavesNothing(t *testing.T) {
	sent := make(chan struct{}, 1)
	aborted := make(chan struct{})
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(1<<20))
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			if _, err := w.Write([]byte{0}); err != nil {
				close(aborted)
				return
			}
			w.(http.Flusher).Flush()
			select {
			case sent <- struct{}{}:
			default:
			}
			select {
			case <-r.Context().Done():
				close(aborted)
				return
			case <-tick.C:
			}
		}
	}))
	t.Cleanup(ts.Close)
	dir := t.TempDir()
	c := loopbackCache(dir)
	sum := strings.Repeat("ab", 32)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := c.Ensure(ctx, ts.URL, sum, nil)
		done <- err
	}()
	<-sent
	require.Eventually(t, func() bool {
		names := dirNames(t, dir)
		return len(names) == 1 && strings.HasSuffix(names[0], ".download.part")
	}, 5*time.Second, time.Millisecond, "precondition: the download is being written")

	cancel()
	select {
	case err := <-done:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(5 * time.Second):
		t.Fatal("Ensure did not return after its caller gave up")
	}
	assert.Empty(t, dirNames(t, dir), "nothing of the download is left when Ensure returns")
	select {
	case <-aborted:
	case <-time.After(5 * time.Second):
		t.Fatal("the server is still sending: the download was not cancelled")
	}
	assert.Zero(t, waiters(c, sum), "the flight is gone")
}
