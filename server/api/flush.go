package api

import (
	"context"
	"net/http"
	"sync"
	"time"
)

// flushGate lets a Watch stream write a batch of events and flush once:
// Connect flushes after every message it sends, and on HTTP/2 each flush is
// a round trip to the connection's writer goroutine and a TLS record, which
// for a watcher that is behind costs more than the messages themselves.
// Only the handler's goroutine touches it.
type flushGate struct {
	http.ResponseWriter
	held bool

	mu    sync.Mutex // guards armed against the cut-off timer
	armed bool
	cut   *time.Timer
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
		next.ServeHTTP(g, r.WithContext(context.WithValue(r.Context(), gateKey{}, g)))
	})
}

// batch runs send with flushes held, then flushes once. A batch that has
// not been written within slowWatcher is cut off: its write fails, so the
// stream ends and the watcher has to reconnect (and start from a fresh
// list). Until then it cost nothing but its coalesced queue — one pending
// event per object — and nobody else waited for it.
func batch(ctx context.Context, send func() error) error {
	g, _ := ctx.Value(gateKey{}).(*flushGate)
	if g == nil {
		return send()
	}
	g.arm()
	defer g.disarm()
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

// arm starts the slow-watcher clock for one batch.
func (g *flushGate) arm() {
	g.mu.Lock()
	g.armed = true
	if g.cut == nil {
		g.cut = time.AfterFunc(slowWatcher, g.cutOff)
	} else {
		g.cut.Reset(slowWatcher)
	}
	g.mu.Unlock()
}

// disarm stops it; once disarmed, a timer that fired late touches nothing
// (the handler may have returned, and its writer with it).
func (g *flushGate) disarm() {
	g.mu.Lock()
	g.armed = false
	g.cut.Stop()
	g.mu.Unlock()
}

func (g *flushGate) cutOff() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.armed {
		// A deadline in the past resets the stream at once, so the blocked
		// write returns.
		_ = http.NewResponseController(g.ResponseWriter).SetWriteDeadline(time.Now())
	}
}

// slowWatcher bounds how long one batch of a Watch stream may take to be
// written (a variable so tests can shorten it).
var slowWatcher = 10 * time.Second
