package syncclient

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

func TestLimiterAllowsABurstThenOnePerInterval(t *testing.T) {
	l := newLimiter(3, 250*time.Millisecond)
	t0 := time.Unix(0, 0)
	for i := range 3 {
		assert.True(t, l.allow(t0), "burst send %d", i)
	}
	assert.False(t, l.allow(t0), "the burst is spent")
	assert.False(t, l.allow(t0.Add(100*time.Millisecond)))
	assert.True(t, l.allow(t0.Add(260*time.Millisecond)), "one more after an interval")
	assert.False(t, l.allow(t0.Add(270*time.Millisecond)))
	assert.True(t, l.allow(t0.Add(time.Hour)), "refills")
}
