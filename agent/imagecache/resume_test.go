package imagecache

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/permanent"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// rangeServer serves an image the way a real web server does: whole (200),
// or from an offset (206 with Content-Range) when asked with Range and, if
// the request has If-Range, only when that matches the current ETag. It
// records every request and can cut a response short by closing the
// connection mid-body.
type rangeServer struct {
	*httptest.Server

	mu            sync.Mutex
	body          []byte
	etag          string
	ignoreRange   bool // always answers 200
	ignoreIfRange bool // answers 206 even when If-Range names another ETag
	reqs          []*http.Request
	// cut says how many body bytes response i sends before the connection
	// is dropped; negative sends all.
	cut func(i int) int
	// pace, when set, sends the body in 16 KiB writes this far apart.
	pace time.Duration
}

func newRangeServer(t *testing.T, body []byte, etag string) *rangeServer {
	s := &rangeServer{body: body, etag: etag}
	s.Server = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.Close)
	return s
}

func (s *rangeServer) serve(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	i := len(s.reqs)
	s.reqs = append(s.reqs, r.Clone(context.Background()))
	body, etag, cut, pace := s.body, s.etag, s.cut, s.pace
	ignoreRange, ignoreIfRange := s.ignoreRange, s.ignoreIfRange
	s.mu.Unlock()

	if etag != "" {
		w.Header().Set("ETag", etag)
	}
	start := 0
	if rg := r.Header.Get("Range"); rg != "" && !ignoreRange {
		if ir := r.Header.Get("If-Range"); ir == "" || ir == etag || ignoreIfRange {
			if _, err := fmt.Sscanf(rg, "bytes=%d-", &start); err != nil || start >= len(body) {
				w.WriteHeader(http.StatusRequestedRangeNotSatisfiable)
				return
			}
		}
	}
	part := body[start:]
	w.Header().Set("Content-Length", strconv.Itoa(len(part)))
	if start > 0 {
		w.Header().Set("Content-Range", fmt.Sprintf("bytes %d-%d/%d", start, len(body)-1, len(body)))
		w.WriteHeader(http.StatusPartialContent)
	} else {
		w.WriteHeader(http.StatusOK)
	}
	n := len(part)
	if cut != nil {
		if c := cut(i); c >= 0 && c < n {
			n = c
		}
	}
	for off := 0; off < n; {
		end := n
		if pace > 0 {
			end = min(off+16<<10, n)
		}
		if _, err := w.Write(part[off:end]); err != nil {
			return
		}
		w.(http.Flusher).Flush()
		off = end
		if pace > 0 && off < n {
			select {
			case <-time.After(pace):
			case <-r.Context().Done():
				return
			}
		}
	}
	if n < len(part) {
		panic(http.ErrAbortHandler) // the connection drops mid-body
	}
}

func (s *rangeServer) requests() []*http.Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*http.Request(nil), s.reqs...)
}

func (s *rangeServer) set(f func(s *rangeServer)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

// cutFirst cuts the first response after n bytes and sends the rest whole.
func cutFirst(n int) func(int) int {
	return func(i int) int {
		if i == 0 {
			return n
		}
		return -1
	}
}

// progressLog collects progress reports and checks they never go back.
type progressLog struct {
	mu      sync.Mutex
	reports [][2]int64
}

func (p *progressLog) report(done, total int64) {
	p.mu.Lock()
	p.reports = append(p.reports, [2]int64{done, total})
	p.mu.Unlock()
}

func (p *progressLog) all() [][2]int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([][2]int64(nil), p.reports...)
}

// wentBack counts the reports lower than the one before.
func (p *progressLog) wentBack() int {
	n := 0
	rs := p.all()
	for i := 1; i < len(rs); i++ {
		if rs[i][0] < rs[i-1][0] {
			n++
		}
	}
	return n
}

func readFile(t *testing.T, p string) []byte {
	t.Helper()
	b, err := os.ReadFile(p)
	require.NoError(t, err)
	return b
}

// A connection that drops mid-download must not start again from byte 0:
// a large image over a flaky link would then never finish. The rest is
// asked for with Range, validated with If-Range, and progress goes on from
// where it was.
func TestACutDownloadResumesWithRangeAndProgressNeverGoesBack(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	srv := newRangeServer(t, body, `"v1"`)
	const cutAt = 300 << 10
	srv.cut = cutFirst(cutAt)
	dir := t.TempDir()
	c := loopbackCache(dir, WithMinProgress(64<<10), WithProgressStep(32<<10))

	var prog progressLog
	p, err := c.Ensure(context.Background(), srv.URL+"/img", sum, prog.report)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(body, readFile(t, p)), "the resumed image is the image")

	reqs := srv.requests()
	require.Len(t, reqs, 2, "one request, then one for the rest")
	assert.Empty(t, reqs[0].Header.Get("Range"))
	assert.Equal(t, fmt.Sprintf("bytes=%d-", cutAt), reqs[1].Header.Get("Range"))
	assert.Equal(t, `"v1"`, reqs[1].Header.Get("If-Range"), "the resume is only for the same image")
	assert.Zero(t, prog.wentBack(), "progress never goes back: %v", prog.all())
	rs := prog.all()
	require.NotEmpty(t, rs)
	assert.Equal(t, [2]int64{int64(len(body)), int64(len(body))}, rs[len(rs)-1])
	assert.Equal(t, []string{sum + ".raw", sum + ".verified"}, dirNames(t, dir))
}

// A failed attempt keeps what it fetched; the next Ensure, even by a new
// process over the same directory, asks for the rest only and reports from
// where it was.
func TestADownloadStoppedByAFailureResumesInTheNextEnsureEvenAfterARestart(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	srv := newRangeServer(t, body, "")
	srv.cut = cutFirst(200 << 10)
	dir := t.TempDir()
	// The cut comes before the stall floor's worth of bytes: this attempt
	// fails, as a flaky link makes one fail.
	_, err := loopbackCache(dir, WithMinProgress(1<<20)).Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.Error(t, err)
	assert.False(t, permanent.Is(err))
	assert.Equal(t, []string{sum + ".download.part", sum + ".download.resume"}, dirNames(t, dir))

	var prog progressLog
	p, err := loopbackCache(dir, WithProgressStep(64<<10)).Ensure(context.Background(), srv.URL+"/img", sum, prog.report)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(body, readFile(t, p)))
	reqs := srv.requests()
	require.Len(t, reqs, 2)
	assert.Equal(t, "bytes=204800-", reqs[1].Header.Get("Range"))
	assert.Empty(t, reqs[1].Header.Get("If-Range"), "no validator was given, none is sent")
	rs := prog.all()
	require.NotEmpty(t, rs)
	assert.Equal(t, [2]int64{200 << 10, 1 << 20}, rs[0], "narration picks up where the failed attempt was")
	assert.Zero(t, prog.wentBack(), "%v", rs)
}

// A server that ignores Range sends the whole image again: the download
// starts over from that answer (no second request), the log says why, and
// progress goes back exactly once.
func TestAServerThatIgnoresRangeGetsTheDownloadStartedOverAndItSaysSo(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	srv := newRangeServer(t, body, `"v1"`)
	srv.ignoreRange = true
	srv.cut = cutFirst(300 << 10)
	var logs hosttest.LogBuffer
	c := loopbackCache(t.TempDir(), WithMinProgress(64<<10), WithProgressStep(32<<10), WithLogger(logs.Logger()))

	var prog progressLog
	p, err := c.Ensure(context.Background(), srv.URL+"/img", sum, prog.report)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(body, readFile(t, p)))
	require.Len(t, srv.requests(), 2)
	assert.NotEmpty(t, srv.requests()[1].Header.Get("Range"), "a resume was asked for")
	assert.Contains(t, logs.String(), "download starts over")
	assert.Contains(t, logs.String(), "sent the whole image again")
	assert.Equal(t, 1, prog.wentBack(), "back once, when it started over: %v", prog.all())
}

// An image that changed on the server between two requests must not be
// stitched together from both: a changed ETag starts the download over,
// whether the server honours If-Range (it sends the new image whole) or not
// (its 206 carries the new ETag).
func TestAChangedETagStartsTheDownloadOver(t *testing.T) {
	for _, honours := range []bool{true, false} {
		t.Run(map[bool]string{true: "server honours If-Range", false: "server ignores If-Range"}[honours], func(t *testing.T) {
			v1, v2 := testImage(1<<20), bytes.Repeat([]byte("second edition "), 70_000)[:1<<20] // same length: only the content says
			srv := newRangeServer(t, v1, `"v1"`)
			srv.ignoreIfRange = !honours
			srv.cut = func(i int) int {
				if i == 0 {
					// The image is replaced while the first response is
					// on the wire.
					srv.set(func(s *rangeServer) { s.body, s.etag = v2, `"v2"` })
					return 300 << 10
				}
				return -1
			}
			var logs hosttest.LogBuffer
			c := loopbackCache(t.TempDir(), WithMinProgress(64<<10), WithLogger(logs.Logger()))
			p, err := c.Ensure(context.Background(), srv.URL+"/img", digest(v2), nil)
			require.NoError(t, err)
			assert.True(t, bytes.Equal(v2, readFile(t, p)), "the new image, whole")
			reqs := srv.requests()
			assert.Equal(t, `"v1"`, reqs[1].Header.Get("If-Range"))
			assert.Contains(t, logs.String(), "download starts over")
			if honours {
				assert.Len(t, reqs, 2)
			} else {
				assert.Contains(t, logs.String(), "ETag changed")
				require.Len(t, reqs, 3, "the changed 206 is dropped and the image asked for whole")
				assert.Empty(t, reqs[2].Header.Get("Range"))
			}
		})
	}
}

// Without any validator a changed image can only show in the digest: a
// resumed download that does not match is fetched once more from byte 0
// before the image is called wrong.
func TestAResumedDownloadThatDoesNotMatchIsFetchedWholeBeforeItIsCalledWrong(t *testing.T) {
	v1, v2 := testImage(1<<20), bytes.Repeat([]byte("second edition "), 70_000)[:1<<20] // same length: only the content says
	srv := newRangeServer(t, v1, "")
	srv.cut = func(i int) int {
		if i == 0 {
			srv.set(func(s *rangeServer) { s.body = v2 })
			return 300 << 10
		}
		return -1
	}
	c := loopbackCache(t.TempDir(), WithMinProgress(64<<10))
	p, err := c.Ensure(context.Background(), srv.URL+"/img", digest(v2), nil)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(v2, readFile(t, p)))
	reqs := srv.requests()
	require.Len(t, reqs, 3)
	assert.NotEmpty(t, reqs[1].Header.Get("Range"))
	assert.Empty(t, reqs[2].Header.Get("Range"), "the last try is whole")
}

// The stall rule holds for every request of a download, resumes included.
func TestAResumedDownloadIsStillHeldToTheStallRule(t *testing.T) {
	body := testImage(1 << 20)
	srv := newRangeServer(t, body, `"v1"`)
	srv.cut = func(i int) int {
		if i == 0 {
			srv.set(func(s *rangeServer) { s.pace = 200 * time.Millisecond }) // the resume trickles
			return 300 << 10
		}
		return -1
	}
	dir := t.TempDir()
	c := loopbackCache(dir, WithMinProgress(64<<10), WithStallTimeout(300*time.Millisecond))
	_, err := c.Ensure(context.Background(), srv.URL+"/img", digest(body), nil)
	require.Error(t, err)
	assert.ErrorIs(t, err, errStalled)
	require.Len(t, srv.requests(), 2)
	assert.NotEmpty(t, srv.requests()[1].Header.Get("Range"))
}

// A resume is a new request and a new connection: it follows redirects
// with its Range, and every hop is checked against the address policy.
func TestAResumeFollowsRedirectsAndIsHeldToTheAddressPolicy(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	blob := newRangeServer(t, body, `"v1"`)
	blob.cut = cutFirst(300 << 10)
	var redirects atomic.Int32
	var target atomic.Value
	target.Store(blob.URL + "/blob")
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		redirects.Add(1)
		http.Redirect(w, r, target.Load().(string), http.StatusFound)
	}))
	t.Cleanup(front.Close)

	t.Run("the Range reaches the last hop", func(t *testing.T) {
		c := loopbackCache(t.TempDir(), WithMinProgress(64<<10))
		p, err := c.Ensure(context.Background(), front.URL+"/img", sum, nil)
		require.NoError(t, err)
		assert.True(t, bytes.Equal(body, readFile(t, p)))
		assert.Equal(t, int32(2), redirects.Load())
		reqs := blob.requests()
		require.Len(t, reqs, 2)
		assert.Equal(t, "bytes=307200-", reqs[1].Header.Get("Range"))
	})
	t.Run("a resume redirected to a refused address is refused", func(t *testing.T) {
		blob.set(func(s *rangeServer) {
			s.reqs = nil
			s.cut = func(i int) int {
				if i == 0 {
					// The resume is sent somewhere the policy does not allow.
					target.Store("http://127.0.0.2:9/blob")
					return 300 << 10
				}
				return -1
			}
		})
		dir := t.TempDir()
		only := netip.MustParsePrefix("127.0.0.1/32")
		c := New(dir, WithDialPolicy(AddressPolicy{Allow: []netip.Prefix{only}}), WithMinProgress(64<<10))
		_, err := c.Ensure(context.Background(), front.URL+"/img", sum, nil)
		requireRefused(t, err, "127.0.0.2", "loopback")
		assert.Empty(t, dirNames(t, dir), "a refused image keeps nothing")
	})
}

// slowServer sends body in 16 KiB pieces every pace, counting requests.
func slowServer(t *testing.T, body []byte, pace time.Duration) *rangeServer {
	s := newRangeServer(t, body, `"v1"`)
	s.pace = pace
	return s
}

// The defect: every pass of a create is bounded (15 min by default) and
// each one that timed out cancelled the shared download, so the next pass
// started again from byte 0, forever. A caller whose deadline passes only
// stops waiting: the download goes on, the next call joins it and hears
// progress from where it is, and it finishes with a single request.
func TestADownloadLongerThanItsCallersDeadlinesFinishesAcrossCalls(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	srv := slowServer(t, body, 20*time.Millisecond) // about 1.3 s in all
	c := loopbackCache(t.TempDir(), WithProgressStep(16<<10), WithMinProgress(16<<10), WithStallTimeout(time.Second))

	var prog progressLog
	calls := 0
	var path string
	for {
		calls++
		require.Less(t, calls, 100, "the download never finished")
		ctx, cancel := context.WithTimeout(context.Background(), 150*time.Millisecond)
		p, err := c.Ensure(ctx, srv.URL+"/img", sum, prog.report)
		cancel()
		if err == nil {
			path = p
			break
		}
		require.ErrorIs(t, err, context.DeadlineExceeded)
		time.Sleep(20 * time.Millisecond) // the gap between passes
	}
	assert.Greater(t, calls, 3, "it took several deadlines")
	assert.True(t, bytes.Equal(body, readFile(t, path)))
	assert.Len(t, srv.requests(), 1, "one request: never started over")
	assert.Zero(t, prog.wentBack(), "progress never goes back across calls: %v", prog.all())
}

// Nobody came back: the download stops after the unattended timeout and
// keeps what it fetched, which the next call resumes.
func TestADownloadNobodyComesBackForStopsButKeepsWhatItFetched(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	srv := slowServer(t, body, 20*time.Millisecond)
	dir := t.TempDir()
	c := loopbackCache(dir, WithUnattendedTimeout(100*time.Millisecond), WithMinProgress(16<<10))
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	_, err := c.Ensure(ctx, srv.URL+"/img", sum, nil)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Eventually(t, func() bool { return waiters(c, sum) == 0 && flightOf(c, sum) == nil }, 5*time.Second, 5*time.Millisecond,
		"the unattended download stops")
	names := dirNames(t, dir)
	assert.Equal(t, []string{sum + ".download.part", sum + ".download.resume"}, names)

	srv.set(func(s *rangeServer) { s.pace = 0 })
	p, err := c.Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(body, readFile(t, p)))
	reqs := srv.requests()
	require.Len(t, reqs, 2)
	assert.NotEmpty(t, reqs[1].Header.Get("Range"), "resumed")
}

// A caller that is cancelled (not timed out) no longer wants the image;
// when it was the last, the download stops and leaves nothing, even one
// that was resumed from an earlier attempt.
func TestCancellingTheLastCallerDiscardsEvenAResumedDownload(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	srv := newRangeServer(t, body, `"v1"`)
	srv.cut = func(i int) int {
		if i == 0 {
			srv.set(func(s *rangeServer) { s.pace = 50 * time.Millisecond })
			return 200 << 10
		}
		return -1
	}
	dir := t.TempDir()
	c := loopbackCache(dir, WithMinProgress(1<<20))
	_, err := c.Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.Error(t, err) // cut: kept for a resume

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		_, err := c.Ensure(ctx, srv.URL+"/img", sum, nil)
		done <- err
	}()
	require.Eventually(t, func() bool { return len(srv.requests()) == 2 }, 5*time.Second, time.Millisecond)
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)
	assert.Empty(t, dirNames(t, dir), "nobody wants it: nothing is kept")
}

// Close stops downloads but keeps what they fetched: an agent that shuts
// down cleanly resumes after its restart.
func TestClosingTheCacheKeepsDownloadsToResume(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	srv := slowServer(t, body, 20*time.Millisecond)
	dir := t.TempDir()
	c := loopbackCache(dir, WithMinProgress(16<<10))
	done := make(chan error, 1)
	go func() {
		_, err := c.Ensure(context.Background(), srv.URL+"/img", sum, nil)
		done <- err
	}()
	require.Eventually(t, func() bool {
		fi, err := os.Stat(c.partPath(sum))
		return err == nil && fi.Size() > 100<<10
	}, 5*time.Second, time.Millisecond)
	c.Close()
	require.Error(t, <-done)
	_, err := c.Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.ErrorIs(t, err, ErrClosed)
	assert.Equal(t, []string{sum + ".download.part", sum + ".download.resume"}, dirNames(t, dir))

	srv.set(func(s *rangeServer) { s.pace = 0 })
	p, err := loopbackCache(dir).Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(body, readFile(t, p)))
	assert.NotEmpty(t, srv.requests()[1].Header.Get("Range"))
}

// Bytes past the last sync may be garbage after a power loss; a resume
// starts from what the record says is on disk, not from the file's length.
func TestAResumeAfterAPowerLossStartsFromTheLastSyncedByte(t *testing.T) {
	body := testImage(1 << 20)
	sum := digest(body)
	srv := newRangeServer(t, body, `"v1"`)
	srv.cut = cutFirst(200 << 10)
	dir := t.TempDir()
	_, err := loopbackCache(dir, WithMinProgress(1<<20)).Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.Error(t, err)
	// What a power loss can do to the unsynced tail: junk past the record.
	f, err := os.OpenFile(filepath.Join(dir, sum+".download.part"), os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.Write(bytes.Repeat([]byte{0xee}, 50_000))
	require.NoError(t, err)
	require.NoError(t, f.Close())

	p, err := loopbackCache(dir).Ensure(context.Background(), srv.URL+"/img", sum, nil)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(body, readFile(t, p)))
	assert.Equal(t, "bytes=204800-", srv.requests()[1].Header.Get("Range"))
}

func flightOf(c *Cache, sha string) *flight {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.flights[sha]
}

// The defect: a cached image was trusted because it existed. After a power
// loss it can exist torn (short, or its data never written); booted, a VM
// gets a broken disk. After a restart each image is checked against its
// record on first use, and one that does not match is fetched again.
func TestATruncatedCachedImageIsFetchedAgainNotUsed(t *testing.T) {
	raw := testImage(1 << 20)
	for _, tc := range []struct {
		name string
		body []byte
	}{
		{"raw", raw},
		{"qcow2", encodeQcow2(t, raw, encOpts{compress: "zlib"})},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts, sum := serve(t, tc.body)
			dir := t.TempDir()
			p, err := loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
			require.NoError(t, err)
			require.NoError(t, os.Truncate(p, 4096)) // the power loss

			// Within the process that placed it, the image is known good.
			// A restart checks it before it is used.
			var logs hosttest.LogBuffer
			c := loopbackCache(dir, WithLogger(logs.Logger()))
			p2, err := c.Ensure(context.Background(), ts.URL, sum, nil)
			require.NoError(t, err)
			assert.Equal(t, p, p2)
			assert.True(t, bytes.Equal(raw, readFile(t, p2)), "the image is whole again")
			assert.Equal(t, int64(2), ts.hits.Load(), "fetched again")
			assert.Contains(t, logs.String(), "cannot be trusted")

			// Checked once: the next use is a plain hit.
			_, err = c.Ensure(context.Background(), ts.URL, sum, nil)
			require.NoError(t, err)
			assert.Equal(t, int64(2), ts.hits.Load())
		})
	}
}

// An intact image survives the restart check without a download.
func TestAnIntactCachedImageIsUsedAfterARestartWithoutAFetch(t *testing.T) {
	raw := testImage(1 << 20)
	ts, sum := serve(t, encodeQcow2(t, raw, encOpts{compress: "zlib"}))
	dir := t.TempDir()
	_, err := loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
	require.NoError(t, err)
	p, err := loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
	require.NoError(t, err)
	assert.True(t, bytes.Equal(raw, readFile(t, p)))
	assert.Equal(t, int64(1), ts.hits.Load())
}

// Images placed by an agent that kept no records (and did not sync) have
// nothing to be checked against but their name: a raw one is re-hashed and
// kept if it is the served bytes; a decoded one cannot be checked and is
// fetched again.
func TestACachedImageWithoutARecordIsReHashedOrFetchedAgain(t *testing.T) {
	raw := testImage(1 << 20)
	for _, tc := range []struct {
		name    string
		body    []byte
		refetch bool
	}{
		{"raw, intact", raw, false},
		{"qcow2", encodeQcow2(t, raw, encOpts{compress: "zlib"}), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ts, sum := serve(t, tc.body)
			dir := t.TempDir()
			_, err := loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
			require.NoError(t, err)
			require.NoError(t, os.Remove(filepath.Join(dir, sum+".verified")))

			p, err := loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
			require.NoError(t, err)
			assert.True(t, bytes.Equal(raw, readFile(t, p)))
			want := int64(1)
			if tc.refetch {
				want = 2
			}
			assert.Equal(t, want, ts.hits.Load())
			assert.FileExists(t, filepath.Join(dir, sum+".verified"), "it has a record now")
		})
	}
	t.Run("raw, torn", func(t *testing.T) {
		ts, sum := serve(t, raw)
		dir := t.TempDir()
		p, err := loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
		require.NoError(t, err)
		require.NoError(t, os.Remove(filepath.Join(dir, sum+".verified")))
		f, err := os.OpenFile(p, os.O_WRONLY, 0)
		require.NoError(t, err)
		_, err = f.WriteAt(make([]byte, 4096), 0) // data that never reached the disk
		require.NoError(t, err)
		require.NoError(t, f.Close())

		p, err = loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
		require.NoError(t, err)
		assert.True(t, bytes.Equal(raw, readFile(t, p)))
		assert.Equal(t, int64(2), ts.hits.Load())
	})
}

// A power loss must not leave an image that exists but was never written:
// every image is synced, then its record written and synced, then renamed
// into place with the directory synced after; the partial download is
// synced before it is recorded as resumable.
func TestACachedImageIsOnDiskBeforeItIsTrusted(t *testing.T) {
	var mu sync.Mutex
	var synced []string
	orig := fsync
	fsync = func(f *os.File) error {
		mu.Lock()
		synced = append(synced, filepath.Base(f.Name()))
		mu.Unlock()
		return orig(f)
	}
	t.Cleanup(func() { fsync = orig })

	raw := testImage(256 << 10)
	for _, tc := range []struct {
		name string
		body []byte
	}{
		{"raw", raw},
		{"gzip", gz(t, raw)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			synced = nil
			mu.Unlock()
			ts, sum := serve(t, tc.body)
			dir := t.TempDir()
			_, err := loopbackCache(dir).Ensure(context.Background(), ts.URL, sum, nil)
			require.NoError(t, err)
			mu.Lock()
			got := strings.Join(synced, " ")
			mu.Unlock()
			d := filepath.Base(dir)
			image := sum + ".download.part" // a raw download is the image
			if tc.name != "raw" {
				image = sum + `\.\d+\.raw\.part` // the decoded temp file
			}
			assert.Regexp(t, `^`+sum+`\.download\.part `+ // download complete, recorded
				sum+`\.download\.resume\.\d+\.part `+
				image+` `+ // the image, before its record
				sum+`\.verified\.\d+\.part `+d+` `+ // the record, then the directory
				d+`$`, // after the rename
				got)
		})
	}
}

func TestContentRange(t *testing.T) {
	for in, want := range map[string][2]int64{
		"bytes 100-199/200": {100, 200},
		"bytes 0-0/*":       {0, -1},
	} {
		first, complete, err := contentRange(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, [2]int64{first, complete}, in)
	}
	for _, bad := range []string{"", "bytes */200", "items 1-2/3", "bytes -1-2/3", "bytes 1-2/x"} {
		_, _, err := contentRange(bad)
		assert.Error(t, err, bad)
	}
}
