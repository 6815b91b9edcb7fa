package store

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

type recordingObserver struct {
	mu  sync.Mutex
	ops map[Op]int
}

func (r *recordingObserver) ObserveStore(op Op, d time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if d < 0 {
		panic("negative duration")
	}
	r.ops[op]++
}

func (r *recordingObserver) count(op Op) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ops[op]
}

func TestTheObserverTimesReadsAndTransactionsOnBothEngines(t *testing.T) {
	eachEngine(t, func(t *testing.T, e engine) {
		ctx := context.Background()
		s, _ := e.open(t)
		obs := &recordingObserver{ops: map[Op]int{}}
		s.Observe(obs)

		require.NoError(t, s.CreateUser(ctx, User{ID: "u1", Name: "alice"}))
		assert.Equal(t, 1, obs.count(OpTransaction), "one write, one transaction")
		if e.name == "sqlite" {
			assert.Equal(t, 1, obs.count(OpWriteWait), "SQLite's writer waited for its slot (if only for nothing)")
		} else {
			assert.Zero(t, obs.count(OpWriteWait), "PostgreSQL's writers take no slot")
		}
		assert.Zero(t, obs.count(OpQuery))

		_, err := s.UserByName(ctx, "alice")
		require.NoError(t, err)
		assert.Equal(t, 1, obs.count(OpQuery))

		s.Observe(nil)
		_, err = s.UserByName(ctx, "alice")
		require.NoError(t, err)
		assert.Equal(t, 1, obs.count(OpQuery), "nothing is observed once the observer is taken away")
	})
}
