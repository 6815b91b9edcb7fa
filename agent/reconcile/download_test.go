package reconcile

import (
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/imagecache"
)

// The defect: a download longer than the pass timeout never finished, as
// each timed-out pass cancelled it and the next started from byte 0. With
// the real image cache and a real server slower than several pass
// timeouts, the create finishes after a few timed-out passes, on a single
// request, spending no attempt, and its narration never goes back.
func TestADownloadLongerThanThePassTimeoutFinishesAcrossPasses(t *testing.T) {
	body := make([]byte, 1<<20)
	r := rand.New(rand.NewPCG(3, 4))
	for i := range body {
		body[i] = byte(r.Uint32())
	}
	var hits atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		hits.Add(1)
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		for off := 0; off < len(body); off += 16 << 10 {
			if _, err := w.Write(body[off : off+16<<10]); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-time.After(20 * time.Millisecond): // about 1.3 s in all
			case <-req.Context().Done():
				return
			}
		}
	}))
	t.Cleanup(srv.Close)
	cache := imagecache.New(t.TempDir(),
		imagecache.WithDialPolicy(imagecache.AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}),
		imagecache.WithProgressStep(64<<10), imagecache.WithMinProgress(16<<10))
	t.Cleanup(cache.Close)
	f := setup(t, func(c *Config) {
		c.VMTimeout = 250 * time.Millisecond
		c.ResyncInterval = 10 * time.Millisecond
		c.Images = unpinned(cache.Ensure)
	})
	d := vm("vm1")
	d.ImageUrl, d.ImageSha256 = srv.URL+"/img", digestOf(body)
	require.True(t, f.eng.Apply(snap(1, d)))

	var said []float64
	var measured []uint64 // done bytes, as Progress carries them
	deadline := time.Now().Add(15 * time.Second)
	for row := f.row("vm1"); row.GetPhase() != "ready"; row = f.row("vm1") {
		require.True(t, time.Now().Before(deadline), "the create never finished: %v", row)
		var done, total float64
		detail := row.GetStatusDetail()
		if _, err := fmt.Sscanf(detail, "downloading image %f/%f MiB", &done, &total); err == nil {
			if len(said) == 0 || said[len(said)-1] != done {
				said = append(said, done)
			}
		}
		if p := row.GetProgress(); p != nil {
			assert.Equal(t, uint64(len(body)), p.GetTotalBytes(), "every measured row knows the size")
			if len(measured) == 0 || measured[len(measured)-1] != p.GetDoneBytes() {
				measured = append(measured, p.GetDoneBytes())
			}
		}
		time.Sleep(2 * time.Millisecond)
	}
	assert.Greater(t, f.passesRun("vm1"), uint64(3), "it took several passes")
	assert.Equal(t, int32(1), hits.Load(), "one request: the download was never started over")
	assert.Zero(t, f.record("vm1").CreateAttempts, "running out of time spends no attempt")
	require.NotEmpty(t, said, "the download narrated its progress")
	for i := 1; i < len(said); i++ {
		assert.GreaterOrEqual(t, said[i], said[i-1], "narration went back: %v", said)
	}
	// The numbers too, across passes: each new pass picks the download up
	// where it was, never from 0 again.
	require.NotEmpty(t, measured, "the download was measured")
	for i := 1; i < len(measured); i++ {
		assert.GreaterOrEqual(t, measured[i], measured[i-1], "progress went back: %v", measured)
	}
	assert.False(t, strings.HasPrefix(f.row("vm1").GetStatusDetail(), "downloading"))
	assert.Nil(t, f.row("vm1").GetProgress(), "a ready VM has no progress")
}
