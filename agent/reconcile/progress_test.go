package reconcile

import (
	"context"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// rowLog collects published rows; a real download publishes from the
// cache's goroutine, so it is locked.
type rowLog struct {
	mu   sync.Mutex
	rows []*eitriv1.ActualVM
}

func (l *rowLog) pub(r *eitriv1.ActualVM) {
	l.mu.Lock()
	l.rows = append(l.rows, r)
	l.mu.Unlock()
}

func (l *rowLog) all() []*eitriv1.ActualVM {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]*eitriv1.ActualVM(nil), l.rows...)
}

func total(n uint64) *uint64 { return &n }

// The fake cache's two reports become two measured rows, with the numbers
// the sentence is made from; every other step carries none.
func TestCreateMeasuresTheDownloadBesideItsWords(t *testing.T) {
	f := setup(t)
	f.eng.cfg.Images = unpinned(func(_ context.Context, _, sha string, progress func(done, total int64)) (string, error) {
		progress(1_288_490_188, 3_972_844_748)
		progress(3_972_844_748, 3_972_844_748)
		return "/cache/" + sha + ".raw", nil
	})
	rows, out := narrate(t, f, context.Background(), vm("vm1"))
	want := map[string]*eitriv1.Progress{
		"downloading image 1.2/3.7 GiB": {Step: "download", DoneBytes: 1_288_490_188, TotalBytes: total(3_972_844_748)},
		"downloading image 3.7/3.7 GiB": {Step: "download", DoneBytes: 3_972_844_748, TotalBytes: total(3_972_844_748)},
	}
	require.Len(t, rows, 7)
	for _, r := range rows {
		w := want[r.GetStatusDetail()]
		if w == nil {
			assert.Nil(t, r.GetProgress(), "%q has nothing to measure", r.GetStatusDetail())
			continue
		}
		assert.True(t, proto.Equal(w, r.GetProgress()), "%q: got %v", r.GetStatusDetail(), r.GetProgress())
	}
	assert.Nil(t, out.row.GetProgress(), "a settled VM has no progress")
}

func TestDownloadProgressNumbers(t *testing.T) {
	for _, c := range []struct {
		name        string
		done, total int64
		want        *eitriv1.Progress
	}{
		{"known total", 5, 10, &eitriv1.Progress{Step: "download", DoneBytes: 5, TotalBytes: total(10)}},
		{"no length from the server", 5, -1, &eitriv1.Progress{Step: "download", DoneBytes: 5}},
		{"zero total is unknown, as in the words", 5, 0, &eitriv1.Progress{Step: "download", DoneBytes: 5}},
		{"nothing yet", 0, 10, &eitriv1.Progress{Step: "download", DoneBytes: 0, TotalBytes: total(10)}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := downloadProgress(c.done, c.total)
			assert.True(t, proto.Equal(c.want, got), "got %v", got)
			assert.Equal(t, c.total > 0, got.TotalBytes != nil, "unset, not 0, when unknown")
		})
	}
}

// A real download through the real cache, from a server that sends its image
// in pieces: the rows count it out with growing done bytes and the total
// when the server declares one (unset when it does not), and once the
// download is over no row carries progress.
func TestARealDownloadIsMeasuredInTheRows(t *testing.T) {
	body := make([]byte, 2<<20)
	r := rand.New(rand.NewPCG(5, 6))
	for i := range body {
		body[i] = byte(r.Uint32())
	}
	for _, declare := range []bool{true, false} {
		t.Run("content-length="+strconv.FormatBool(declare), func(t *testing.T) {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
				if declare {
					w.Header().Set("Content-Length", strconv.Itoa(len(body)))
				}
				// Flushed pieces: without a declared length the answer is
				// chunked, and the cache never learns the size.
				for off := 0; off < len(body); off += 64 << 10 {
					if _, err := w.Write(body[off : off+64<<10]); err != nil {
						return
					}
					w.(http.Flusher).Flush()
				}
			}))
			t.Cleanup(srv.Close)
			cache := imagecache.New(t.TempDir(),
				imagecache.WithDialPolicy(imagecache.AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}),
				imagecache.WithProgressStep(64<<10))
			t.Cleanup(cache.Close)
			f := setup(t, func(c *Config) { c.Images = unpinned(cache.Ensure) })
			d := vm("vm1")
			d.ImageUrl, d.ImageSha256 = srv.URL+"/img", digestOf(body)

			var log rowLog
			out := f.eng.create(context.Background(), d, state.Record{}, false, log.pub)
			require.Equal(t, "ready", out.row.GetPhase(), "%v", out.row)
			assert.Nil(t, out.row.GetProgress())

			var done []uint64
			lastMeasured := -1
			rows := log.all()
			for i, row := range rows {
				p := row.GetProgress()
				if p == nil {
					continue
				}
				lastMeasured = i
				assert.Equal(t, "download", p.GetStep())
				assert.Equal(t, declare, p.TotalBytes != nil, "total set exactly when the server declared it: %v", p)
				if declare {
					assert.Equal(t, uint64(len(body)), p.GetTotalBytes())
				}
				assert.Equal(t, downloadDetail(int64(p.GetDoneBytes()), map[bool]int64{true: int64(len(body)), false: -1}[declare]),
					row.GetStatusDetail(), "the words and the numbers come from one report")
				done = append(done, p.GetDoneBytes())
			}
			require.GreaterOrEqual(t, len(done), 3, "the answer, then at least two pieces: %v", done)
			assert.Zero(t, done[0], "measured from the answer, before any byte")
			assert.Equal(t, uint64(len(body)), done[len(done)-1])
			for i := 1; i < len(done); i++ {
				assert.Greater(t, done[i], done[i-1], "done bytes only grow: %v", done)
			}
			require.Less(t, lastMeasured, len(rows)-1)
			for _, row := range rows[lastMeasured+1:] {
				assert.Nil(t, row.GetProgress(), "%q comes after the download", row.GetStatusDetail())
			}
		})
	}
}
