package reconcile

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// planned takes jitter out, so a test can say exactly how long a backoff is.
func planned(c *Config) { c.Jitter = func(d time.Duration) time.Duration { return d } }

func retried(d *eitriv1.VMDesired, n uint64) *eitriv1.VMDesired {
	d.Retry = n
	return d
}

func TestBackoffDoublesUpToItsCap(t *testing.T) {
	f := setup(t, planned, func(c *Config) { c.RetryBackoff, c.MaxRetryBackoff = 20*time.Second, 5*time.Minute })
	var got []time.Duration
	for n := 1; n <= 6; n++ {
		got = append(got, f.eng.backoff(n))
	}
	assert.Equal(t, []time.Duration{20 * time.Second, 40 * time.Second, 80 * time.Second, 160 * time.Second, 5 * time.Minute, 5 * time.Minute}, got)
	assert.Zero(t, f.eng.restartDelay(1), "one crash is no pattern: the first restart is at once")
	assert.Equal(t, 20*time.Second, f.eng.restartDelay(2))
}

func TestJitterKeepsHalfTheWaitAndSpreadsTheRest(t *testing.T) {
	seen := map[time.Duration]bool{}
	for range 200 {
		d := equalJitter(40 * time.Second)
		require.GreaterOrEqual(t, d, 20*time.Second)
		require.LessOrEqual(t, d, 40*time.Second)
		seen[d] = true
	}
	assert.Greater(t, len(seen), 10, "VMs failed by one outage must not retry in step")
}

// A passing outage must not fail a VM within seconds: each attempt waits
// out a doubling backoff, and the row says when the next is.
func TestAFailedCreateAttemptWaitsOutItsBackoffAndSaysWhen(t *testing.T) {
	f := setup(t, planned, func(c *Config) {
		c.RetryBackoff, c.MaxRetryBackoff = 20*time.Second, 5*time.Minute
		c.ResyncInterval = 2 * time.Millisecond // passes keep running; only the clock lets an attempt through
	})
	var fetches atomic.Int32
	f.eng.cfg.Images = unpinned(func(context.Context, string, string, func(int64, int64)) (string, error) {
		fetches.Add(1)
		return "", errors.New("dial tcp 192.0.2.7:443: connect: connection refused")
	})
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	r := f.eventuallyRow("vm1", detailIs("attempt 1 of 5 failed: dial tcp 192.0.2.7:443: connect: connection refused; retrying in 20 s"), "the first failure says when the next try is")
	assert.Equal(t, "creating", r.GetPhase(), "not failed while the budget lasts")
	assert.Equal(t, "dial tcp 192.0.2.7:443: connect: connection refused", r.GetLastError())
	f.waitPasses("vm1", 5)
	assert.Equal(t, int32(1), fetches.Load(), "no attempt before its time, however many passes run")

	f.clock.Advance(15 * time.Second)
	f.eventuallyRow("vm1", detailIs("attempt 1 of 5 failed: dial tcp 192.0.2.7:443: connect: connection refused; retrying in 5 s"), "the wait counts down")
	assert.Equal(t, int32(1), fetches.Load())

	for n, wait := range []string{"40 s", "1 min 20 s", "2 min 40 s"} {
		f.clock.Advance(5 * time.Minute)
		want := fmt.Sprintf("attempt %d of 5 failed: dial tcp 192.0.2.7:443: connect: connection refused; retrying in %s", n+2, wait)
		f.eventuallyRow("vm1", detailIs(want), "each wait doubles")
	}
	assert.Equal(t, int32(4), fetches.Load())
	assert.Equal(t, f.clock.Now().Add(160*time.Second), f.record("vm1").NextAttemptAt, "the wait is kept durably")

	f.clock.Advance(5 * time.Minute)
	r = f.eventuallyRow("vm1", phaseIs("failed"), "the fifth failure spends the budget")
	assert.Empty(t, r.GetStatusDetail())
	assert.Equal(t, int32(5), fetches.Load())
}

// A backoff ends when it said it would, not at the next resync.
func TestABackoffEndsOnItsOwnTimer(t *testing.T) {
	f := setup(t, planned, func(c *Config) {
		c.Now = time.Now
		c.RetryBackoff = 30 * time.Millisecond
		c.ResyncInterval = time.Hour
	})
	var fetches atomic.Int32
	f.eng.cfg.Images = unpinned(func(_ context.Context, _, sha string, _ func(int64, int64)) (string, error) {
		if fetches.Add(1) == 1 {
			return "", errors.New("503 Service Unavailable")
		}
		return "/cache/" + sha + ".raw", nil
	})
	require.True(t, f.eng.Apply(snap(1, vm("vm1"))))
	f.eventuallyRow("vm1", phaseIs("ready"), "the second attempt runs after the backoff, unasked")
	assert.Equal(t, int32(2), fetches.Load())
	assert.Zero(t, f.record("vm1").NextAttemptAt, "a create that succeeded waits for nothing")
}

// An agent restarted during a backoff does not start the next attempt early.
func TestABackoffOutlivesAnAgentRestart(t *testing.T) {
	f := setup(t, planned)
	f.eng.cfg.Images = unpinned(func(context.Context, string, string, func(int64, int64)) (string, error) {
		return "", errors.New("no space left on device")
	})
	f.apply(snap(1, vm("vm1")))
	require.Equal(t, 1, f.record("vm1").CreateAttempts)
	f.eng.Close()

	var fetches atomic.Int32
	g := setupOn(t, f.st, newFakeHyper(), planned)
	g.clock.now = f.clock.Now().Add(5 * time.Second)
	g.eng.cfg.Images = unpinned(func(context.Context, string, string, func(int64, int64)) (string, error) {
		fetches.Add(1)
		return "", errors.New("no space left on device")
	})
	r := findVM(g.apply(snap(1, vm("vm1"))), "vm1")
	assert.Equal(t, "attempt 1 of 5 failed: no space left on device; retrying in 15 s", r.GetStatusDetail())
	assert.Zero(t, fetches.Load())
}

func TestARetryStartsAFailedCreateOverOnce(t *testing.T) {
	f := setup(t)
	var fetches atomic.Int32
	var broken atomic.Bool
	broken.Store(true)
	f.eng.cfg.Images = unpinned(func(_ context.Context, _, sha string, _ func(int64, int64)) (string, error) {
		fetches.Add(1)
		if broken.Load() {
			return "", permErr{"sha256 mismatch"}
		}
		return "/cache/" + sha + ".raw", nil
	})
	r := findVM(f.apply(snap(1, vm("vm1"))), "vm1")
	require.Equal(t, "failed", r.GetPhase())
	assert.Zero(t, r.GetRetry())

	// The same retry twice is one retry: failed again under it stays failed.
	r = findVM(f.apply(snap(2, retried(vm("vm1"), 1))), "vm1")
	assert.Equal(t, "failed", r.GetPhase())
	assert.Equal(t, uint64(1), r.GetRetry(), "the row answers the retry")
	assert.Equal(t, int32(2), fetches.Load(), "the retry fetched again")
	d := retried(vm("vm1"), 1)
	d.Vcpus = 2
	f.apply(snap(3, d))
	assert.Equal(t, int32(2), fetches.Load(), "an answered retry is not answered again")

	broken.Store(false)
	r = findVM(f.apply(snap(4, retried(vm("vm1"), 2))), "vm1")
	assert.Equal(t, "ready", r.GetPhase())
	assert.Equal(t, uint64(2), r.GetRetry())
	rec := f.record("vm1")
	assert.Equal(t, uint64(2), rec.Retry)
	assert.False(t, rec.Failed)
	assert.Zero(t, rec.CreateAttempts)
}

func TestWaitWords(t *testing.T) {
	for d, want := range map[time.Duration]string{
		300 * time.Millisecond:   "1 s",
		40 * time.Second:         "40 s",
		59500 * time.Millisecond: "1 min",
		2 * time.Minute:          "2 min",
		160 * time.Second:        "2 min 40 s",
	} {
		assert.Equal(t, want, waitWords(d), "%s", d)
	}
	assert.Equal(t, "first line, cut", shortReason("first line, cut;\nserial console:\nmore"))
}
