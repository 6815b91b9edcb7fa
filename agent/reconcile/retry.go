package reconcile

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// backoff is the wait after the n-th failure in a row (n >= 1):
// RetryBackoff doubled for each failure before it, capped at
// MaxRetryBackoff, then jittered. Without it a short outage (an image
// server restarting, a disk filling and freed) spends a whole budget in
// seconds.
func (e *Engine) backoff(n int) time.Duration {
	d := e.cfg.RetryBackoff
	for i := 1; i < n && d < e.cfg.MaxRetryBackoff; i++ {
		d *= 2
	}
	return e.cfg.Jitter(min(d, e.cfg.MaxRetryBackoff))
}

// equalJitter keeps half of d and draws the rest, so a wait stays within a
// factor of two of the plan while VMs one outage failed together spread out.
func equalJitter(d time.Duration) time.Duration {
	if d <= 1 {
		return d
	}
	half := d / 2
	return half + rand.N(d-half+1)
}

// restartDelay is the wait before restart number n in a row: the first
// restart is at once (one crash is no pattern), later ones back off.
func (e *Engine) restartDelay(n int) time.Duration {
	if n <= 1 {
		return 0
	}
	return e.backoff(n - 1)
}

// applyRetry answers a retry (RetryVM) the record has not answered yet: the
// failure and both budgets are cleared, so the VM is tried again at once.
// It reports whether rec changed.
func applyRetry(d *eitriv1.VMDesired, rec *state.Record) bool {
	if d.GetRetry() <= rec.Retry {
		return false
	}
	rec.Retry = d.GetRetry()
	rec.Failed = false
	rec.LastError = ""
	rec.CreateAttempts, rec.NextAttemptAt = 0, time.Time{}
	rec.Restarts, rec.RestartAt, rec.RestartReason = 0, time.Time{}, ""
	return true
}

// waitWords says a wait as people read it, rounded up to the second:
// "40 s", "2 min 5 s".
func waitWords(d time.Duration) string {
	s := int64((d + time.Second - 1) / time.Second)
	if s < 60 {
		return fmt.Sprintf("%d s", max(s, 1))
	}
	if s%60 == 0 {
		return fmt.Sprintf("%d min", s/60)
	}
	return fmt.Sprintf("%d min %d s", s/60, s%60)
}

// maxReasonInDetail bounds the part of an error narration repeats; the
// whole error is in last_error.
const maxReasonInDetail = 200

// shortReason is the first line of an error, cut to fit in narration.
func shortReason(msg string) string {
	if i := strings.IndexByte(msg, '\n'); i >= 0 {
		msg = msg[:i]
	}
	msg = strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(msg), ";"))
	if r := []rune(msg); len(r) > maxReasonInDetail {
		msg = string(r[:maxReasonInDetail-1]) + "…"
	}
	return msg
}

// attemptFailedWords narrates a create waiting out its backoff.
func (e *Engine) attemptFailedWords(rec state.Record, wait time.Duration) string {
	return fmt.Sprintf("attempt %d of %d failed: %s; %s",
		rec.CreateAttempts, e.cfg.MaxCreateAttempts, shortReason(rec.LastError), retryingIn("retrying", wait))
}

// retryingIn says when something is tried again: "retrying in 40 s", or
// "retrying now" when there is no wait.
func retryingIn(what string, wait time.Duration) string {
	if wait <= 0 {
		return what + " now"
	}
	return what + " in " + waitWords(wait)
}
