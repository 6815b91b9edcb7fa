package exposeproxy

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// TestStreakWarnsAtMostOncePerInterval: a condition that comes and goes is
// logged when it starts, again only once warnEvery has passed since the last
// warning, and that warning counts the streaks it stood for.
func TestStreakWarnsAtMostOncePerInterval(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	type step struct {
		at       time.Duration // since t0
		end      bool          // the condition clears instead
		warn     bool
		unlogged int
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"first streak warns", []step{{at: 0, warn: true}}},
		{"a streak warns once", []step{{at: 0, warn: true}, {at: time.Second}, {at: 2 * warnEvery}}},
		{"streaks inside the interval are held back", []step{
			{at: 0, warn: true}, {end: true}, {at: time.Second}, {end: true}, {at: 2 * time.Second},
		}},
		{"the next warning counts the held-back ones", []step{
			{at: 0, warn: true}, {end: true}, {at: time.Second}, {end: true}, {at: 2 * time.Second},
			{end: true}, {at: warnEvery, warn: true, unlogged: 2},
			{end: true}, {at: warnEvery + time.Second},
			{end: true}, {at: 2*warnEvery + time.Second, warn: true, unlogged: 1},
		}},
		{"after a quiet interval no count", []step{
			{at: 0, warn: true}, {end: true}, {at: 3 * warnEvery, warn: true},
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var s streak
			for i, st := range tc.steps {
				if st.end {
					s.end()
					continue
				}
				at := t0.Add(st.at)
				warn, unlogged := s.begin(func() time.Time { return at })
				assert.Equal(t, st.warn, warn, "step %d", i)
				assert.Equal(t, st.unlogged, unlogged, "step %d", i)
			}
		})
	}
}

// TestStreakReadsTheClockOnlyWhenOneStarts: every refusal inside a streak
// calls begin, so on a datagram flood at the cap the clock must stay unread.
func TestStreakReadsTheClockOnlyWhenOneStarts(t *testing.T) {
	reads := 0
	clock := func() time.Time { reads++; return time.Unix(0, 0) }
	var s streak
	for range 1000 {
		s.begin(clock)
	}
	assert.Equal(t, 1, reads)
	s.end()
	s.begin(clock)
	assert.Equal(t, 2, reads)
}
