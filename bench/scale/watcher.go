package main

import (
	"context"
	"crypto/tls"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// tracks holds when each change left its agent, by object and sequence.
type tracks struct {
	mu     sync.RWMutex // read by every watcher on every delivery
	at     map[string]map[uint64]time.Time
	latest map[string]uint64
	kind   map[string]string // object → "vms" or "exposures"
	home   map[string]int    // object → the replica its agent reports to
	n      atomic.Int64      // changes sent so far
	// from is when the window opened (unix ns): changes sent before it
	// are delivered and tracked, but not measured.
	from atomic.Int64
}

func newTracks() *tracks {
	t := &tracks{at: map[string]map[uint64]time.Time{}, latest: map[string]uint64{}, kind: map[string]string{}, home: map[string]int{}}
	t.from.Store(math.MaxInt64) // nothing is measured until the window opens
	return t
}

// sent records that change seq of obj left an agent connected to replica
// home at now.
func (t *tracks) sent(kind, obj string, seq uint64, now time.Time, home int) {
	t.n.Add(1)
	t.mu.Lock()
	defer t.mu.Unlock()
	t.kind[obj] = kind
	t.home[obj] = home
	m := t.at[obj]
	if m == nil {
		m = map[uint64]time.Time{}
		t.at[obj] = m
	}
	m[seq] = now
	t.latest[obj] = max(t.latest[obj], seq)
}

// when is when change seq of obj left its agent, and the replica that
// agent reports to.
func (t *tracks) when(obj string, seq uint64) (time.Time, int, bool) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	at, ok := t.at[obj][seq]
	return at, t.home[obj], ok
}

// sample is one delivery's latency and when its change was sent.
type sample struct {
	at time.Time
	d  time.Duration
}

// watcher is one console: a WatchVMs or WatchExposures stream, over the
// Connect protocol or gRPC, on its own connection.
type watcher struct {
	kind    string // "vms" or "exposures"
	grpc    bool
	replica int // the replica it watches through

	mu        sync.Mutex
	seen      map[string]uint64 // object → newest sequence received
	lat       []time.Duration   // change sent → received, one per delivery
	cross     []sample          // those of objects whose agent is on another replica
	same      []time.Duration   // and those on the same one
	msgs      int64
	err       error
	connected chan struct{}
}

// seqOf reads the "(#N)" the simulated agents end their narration with.
func seqOf(detail string) (uint64, bool) {
	i := strings.LastIndex(detail, "(#")
	if i < 0 || !strings.HasSuffix(detail, ")") {
		return 0, false
	}
	n, err := strconv.ParseUint(detail[i+2:len(detail)-1], 10, 64)
	return n, err == nil
}

func (w *watcher) saw(t *tracks, obj string, seq uint64, now time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now.UnixNano() >= t.from.Load() {
		w.msgs++ // the per-delivery figures divide the window's CPU by these
	}
	if seq == 0 || seq <= w.seen[obj] {
		return
	}
	w.seen[obj] = seq
	if at, home, ok := t.when(obj, seq); ok && at.UnixNano() >= t.from.Load() {
		d := now.Sub(at)
		w.lat = append(w.lat, d)
		if home != w.replica {
			w.cross = append(w.cross, sample{at, d})
		} else {
			w.same = append(w.same, d)
		}
	}
}

func (w *watcher) run(ctx context.Context, url, token string, t *tracks) {
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, Protocols: new(http.Protocols)}
	tr.Protocols.SetHTTP2(true)
	defer tr.CloseIdleConnections()
	opts := []connect.ClientOption{connect.WithInterceptors(connclient.Bearer(token)), connect.WithCodec(leanCodec{})}
	if w.grpc {
		opts = append(opts, connect.WithGRPC())
	}
	hc := &http.Client{Transport: tr}
	fail := func(err error) {
		w.mu.Lock()
		if w.err == nil && ctx.Err() == nil {
			w.err = err
		}
		w.mu.Unlock()
	}
	once := sync.OnceFunc(func() { close(w.connected) })
	defer once()
	switch w.kind {
	case "vms":
		st, err := eitriv1connect.NewVMServiceClient(hc, url, opts...).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
		if err != nil {
			fail(err)
			return
		}
		defer st.Close()
		for st.Receive() {
			once()
			now := time.Now()
			m := st.Msg()
			if v := m.GetChanged(); v != nil {
				seq, _ := seqOf(v.GetStatusDetail())
				w.saw(t, v.GetId(), seq, now)
			}
		}
		fail(st.Err())
	case "exposures":
		st, err := eitriv1connect.NewExposureServiceClient(hc, url, opts...).WatchExposures(ctx, connect.NewRequest(&eitriv1.WatchExposuresRequest{}))
		if err != nil {
			fail(err)
			return
		}
		defer st.Close()
		for st.Receive() {
			once()
			now := time.Now()
			if e := st.Msg().GetChanged(); e != nil {
				w.saw(t, e.GetId(), uint64(e.GetSessions().GetActive()), now)
			}
		}
		fail(st.Err())
	}
}
