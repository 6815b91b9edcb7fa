package watch

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func next(t *testing.T, w *Watcher[int]) []Event[int] {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	evs, err := w.Next(ctx)
	require.NoError(t, err)
	return evs
}

func TestEventsArriveInOrder(t *testing.T) {
	top := NewTopic[int]()
	w := top.Subscribe(nil)
	defer w.Close()
	top.Publish(Event[int]{ID: "a", Obj: 1})
	top.Publish(Event[int]{ID: "b", Obj: 2})
	top.Publish(Event[int]{ID: "c", Removed: true})
	evs := next(t, w)
	require.Len(t, evs, 3)
	assert.Equal(t, []string{"a", "b", "c"}, []string{evs[0].ID, evs[1].ID, evs[2].ID})
	assert.True(t, evs[2].Removed)
}

func TestASlowWatcherIsCoalescedToTheLatestStatePerObject(t *testing.T) {
	top := NewTopic[int]()
	w := top.Subscribe(nil)
	defer w.Close()
	for i := range 10_000 {
		top.Publish(Event[int]{ID: fmt.Sprintf("vm%d", i%3), Obj: i})
	}
	evs := next(t, w)
	require.Len(t, evs, 3, "one pending event per object, however many changes")
	assert.Equal(t, 9999, evs[0].Obj) // vm0 last written at 9999
	assert.Equal(t, 9997, evs[1].Obj)
	assert.Equal(t, 9998, evs[2].Obj)
}

func TestFilterHidesOtherOwners(t *testing.T) {
	top := NewTopic[int]()
	w := top.Subscribe(func(ev Event[int]) bool { return ev.Owner == "alice" })
	defer w.Close()
	top.Publish(Event[int]{ID: "x", Owner: "bob", Obj: 1})
	top.Publish(Event[int]{ID: "y", Owner: "alice", Obj: 2})
	evs := next(t, w)
	require.Len(t, evs, 1)
	assert.Equal(t, "y", evs[0].ID)
}

func TestNextHonoursContext(t *testing.T) {
	top := NewTopic[int]()
	w := top.Subscribe(nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := w.Next(ctx)
	assert.ErrorIs(t, err, context.Canceled)
	w.Close()
	assert.Equal(t, 0, top.Watchers())
}

// A watcher that never reads must not hold up the publisher or the others.
func TestAStuckWatcherDoesNotSlowOthers(t *testing.T) {
	top := NewTopic[int]()
	stuck := top.Subscribe(nil)
	defer stuck.Close()
	live := top.Subscribe(nil)
	defer live.Close()
	done := make(chan struct{})
	go func() {
		for i := range 100_000 {
			top.Publish(Event[int]{ID: "vm", Obj: i})
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("publisher blocked behind a watcher that never reads")
	}
	evs := next(t, live)
	assert.Equal(t, 99_999, evs[len(evs)-1].Obj)
}

func BenchmarkPublish100Watchers(b *testing.B) {
	top := NewTopic[int]()
	for range 100 {
		w := top.Subscribe(nil)
		defer w.Close()
	}
	b.ResetTimer()
	for i := range b.N {
		top.Publish(Event[int]{ID: fmt.Sprintf("vm%d", i%1000), Obj: i})
	}
}

func TestEveryWatcherSharesOneMemoPerEvent(t *testing.T) {
	top := NewTopic[int]()
	a, b := top.Subscribe(nil), top.Subscribe(nil)
	defer a.Close()
	defer b.Close()
	top.Publish(Event[int]{ID: "vm", Obj: 1})
	builds := 0
	build := func() any { builds++; return new(int) }
	ea, eb := next(t, a)[0], next(t, b)[0]
	assert.Same(t, ea.Memo.Do(build), eb.Memo.Do(build), "both watchers send the same message")
	assert.Equal(t, 1, builds)
}

// What arrives while a stream settles joins the batch it is about to
// write, coalesced with what was already pending.
func TestChangesArrivingWhileSettlingJoinTheBatch(t *testing.T) {
	top := NewTopic[int]()
	w := top.Subscribe(nil)
	defer w.Close()
	top.Publish(Event[int]{ID: "a", Obj: 1})
	settled := 0
	evs, err := w.NextSettled(context.Background(), func(context.Context) error {
		settled++
		top.Publish(Event[int]{ID: "b", Obj: 2})
		top.Publish(Event[int]{ID: "a", Obj: 3})
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, 1, settled)
	require.Len(t, evs, 2)
	assert.Equal(t, []Event[int]{{ID: "a", Obj: 3}, {ID: "b", Obj: 2}}, []Event[int]{{ID: evs[0].ID, Obj: evs[0].Obj}, {ID: evs[1].ID, Obj: evs[1].Obj}})

	// Nothing pending: settle is not called until something is.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = w.NextSettled(ctx, func(context.Context) error { settled++; return nil })
	assert.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 1, settled)
}
