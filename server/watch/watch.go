// Package watch fans per-object change events out to Watch* streams.
//
// A Topic never blocks its publisher: each watcher keeps at most one pending
// event per object id (the latest), so a slow reader is coalesced to the
// newest state of each object instead of growing a buffer or slowing the
// agents whose reports caused the change.
package watch

import (
	"context"
	"sync"
)

// Event is one object's new state, or its removal. Obj is built once per
// change and shared by every watcher, so it must not be mutated after
// Publish.
type Event[T any] struct {
	ID      string
	Owner   string // the object's owner; used by watcher filters
	Obj     T
	Removed bool
	// Memo is shared by every watcher handed this event (Publish sets it),
	// so what a watcher derives from it — the message it sends — is built
	// and encoded once per change, not once per watcher.
	Memo *Memo
}

// Memo holds one value derived from an event.
type Memo struct {
	once sync.Once
	v    any
}

// Do returns the memoized value, computing it with f the first time.
func (m *Memo) Do(f func() any) any {
	m.once.Do(func() { m.v = f() })
	return m.v
}

// Topic is one stream of change events (VMs, hosts or exposures).
type Topic[T any] struct {
	mu       sync.Mutex
	watchers map[*Watcher[T]]struct{}
}

// NewTopic returns an empty topic.
func NewTopic[T any]() *Topic[T] {
	return &Topic[T]{watchers: make(map[*Watcher[T]]struct{})}
}

// Publish hands ev to every watcher whose filter accepts it. It returns
// without waiting for any of them.
func (t *Topic[T]) Publish(ev Event[T]) {
	if ev.Memo == nil {
		ev.Memo = new(Memo)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for w := range t.watchers {
		if w.filter == nil || w.filter(ev) {
			w.offer(ev)
		}
	}
}

// Watchers reports how many watchers are subscribed (for tests and metrics).
func (t *Topic[T]) Watchers() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.watchers)
}

// Subscribe registers a watcher. Subscribe before reading the current list,
// so that no change made while the list is being read is missed: at worst an
// object is sent twice, and every send is the object whole.
func (t *Topic[T]) Subscribe(filter func(Event[T]) bool) *Watcher[T] {
	w := &Watcher[T]{
		topic:   t,
		filter:  filter,
		pending: make(map[string]int),
		ready:   make(chan struct{}, 1),
	}
	t.mu.Lock()
	t.watchers[w] = struct{}{}
	t.mu.Unlock()
	return w
}

// Watcher is one subscriber's coalescing queue.
type Watcher[T any] struct {
	topic  *Topic[T]
	filter func(Event[T]) bool

	mu sync.Mutex
	// queue keeps first-arrival order; pending maps an id to its slot, so a
	// newer event for the same object replaces the older one in place.
	queue   []Event[T]
	pending map[string]int
	ready   chan struct{}
}

func (w *Watcher[T]) offer(ev Event[T]) {
	w.mu.Lock()
	if i, ok := w.pending[ev.ID]; ok {
		w.queue[i] = ev
	} else {
		w.pending[ev.ID] = len(w.queue)
		w.queue = append(w.queue, ev)
	}
	w.mu.Unlock()
	select {
	case w.ready <- struct{}{}:
	default:
	}
}

// Next blocks until at least one event is pending and returns all pending
// events in order, or returns ctx's error.
func (w *Watcher[T]) Next(ctx context.Context) ([]Event[T], error) {
	return w.NextSettled(ctx, nil)
}

// NextSettled is Next that, once something is pending, calls settle (if
// not nil) before taking the queue: what arrives while settle waits joins
// the same batch, still coalesced per object. A stream uses it to pace its
// writes, so that a busy watcher is woken and written to once per interval
// with everything new rather than once per change.
func (w *Watcher[T]) NextSettled(ctx context.Context, settle func(context.Context) error) ([]Event[T], error) {
	for {
		w.mu.Lock()
		n := len(w.queue)
		w.mu.Unlock()
		if n > 0 {
			break
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-w.ready:
		}
	}
	if settle != nil {
		if err := settle(ctx); err != nil {
			return nil, err
		}
	}
	w.mu.Lock()
	out := w.queue
	w.queue = nil
	clear(w.pending)
	w.mu.Unlock()
	return out, nil
}

// Close unsubscribes the watcher.
func (w *Watcher[T]) Close() {
	w.topic.mu.Lock()
	delete(w.topic.watchers, w)
	w.topic.mu.Unlock()
}
