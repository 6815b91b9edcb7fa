package api

import (
	"context"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// flushGate lets a Watch stream write a batch of events and flush once:
// Connect flushes after every message it sends, and on HTTP/2 each flush is
// a round trip to the connection's writer goroutine and a TLS record, which
// for a watcher that is behind costs more than the messages themselves.
// Only the handler's goroutine touches held and since's writes.
type flushGate struct {
	http.ResponseWriter
	held bool

	// since is when the batch being written started (unix ns), 0 between
	// batches. A batch sets and clears it with two atomic stores: a timer
	// reset and stop per batch, under a mutex, cost ~2% of the control
	// plane at a thousand watchers.
	since atomic.Int64

	mu     sync.Mutex // orders a check against the handler's end
	done   bool
	checks *time.Timer
}

func (g *flushGate) Flush() {
	if g.held {
		return
	}
	if f, ok := g.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// Unwrap lets http.ResponseController reach the real writer (deadlines).
func (g *flushGate) Unwrap() http.ResponseWriter { return g.ResponseWriter }

type gateKey struct{}

// withFlushGate gives each request's handler a gate in its context.
func withFlushGate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		g := &flushGate{ResponseWriter: w}
		defer g.close()
		next.ServeHTTP(g, r.WithContext(context.WithValue(r.Context(), gateKey{}, g)))
	})
}

// gateOf is the request's flush gate, nil outside withFlushGate.
func gateOf(ctx context.Context) *flushGate {
	g, _ := ctx.Value(gateKey{}).(*flushGate)
	return g
}

// batch runs send with flushes held, then flushes once. A batch that has
// not been written within slowWatcher (checked every slowWatcher/4) is cut
// off: its write fails, so the stream ends and the watcher has to reconnect
// (and start from a fresh list). Until then it cost nothing but its
// coalesced queue — one pending event per object — and nobody else waited
// for it.
func (g *flushGate) batch(send func() error) error {
	if g == nil {
		return send()
	}
	g.watch()
	g.since.Store(time.Now().UnixNano())
	defer g.since.Store(0)
	g.held = true
	err := send()
	g.held = false
	if err != nil {
		return err
	}
	if f, ok := g.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
	return nil
}

// watch starts the periodic check on the first batch: a stream that
// never batches (no Watch) costs no timer.
func (g *flushGate) watch() {
	if g.checks != nil {
		return
	}
	g.mu.Lock()
	g.checks = time.AfterFunc(slowWatcher/4, g.check)
	g.mu.Unlock()
}

func (g *flushGate) check() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.done {
		return // the handler returned, and its writer with it
	}
	if t := g.since.Load(); t != 0 && time.Since(time.Unix(0, t)) >= slowWatcher {
		// A deadline in the past resets the stream at once, so the blocked
		// write returns.
		_ = http.NewResponseController(g.ResponseWriter).SetWriteDeadline(time.Now())
		return
	}
	g.checks.Reset(slowWatcher / 4)
}

func (g *flushGate) close() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.done = true
	if g.checks != nil {
		g.checks.Stop()
	}
}

// slowWatcher bounds how long one batch of a Watch stream may take to be
// written (a variable so tests can shorten it).
var slowWatcher = 10 * time.Second
