package fleet

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/server/store"
)

func pendingRollout(maxUnavailable int, hosts ...string) *store.Rollout {
	ro := &store.Rollout{ID: "ro-1", Version: "v2", State: store.RolloutCanary, MaxUnavailable: maxUnavailable}
	for _, h := range hosts {
		ro.Hosts = append(ro.Hosts, store.RolloutHost{HostID: h, HostName: h, State: store.HostPending})
	}
	return ro
}

func states(ro *store.Rollout) []string {
	var out []string
	for _, h := range ro.Hosts {
		out = append(out, h.State)
	}
	return out
}

func TestTheCanaryGoesAloneThenWavesNeverExceedMaxUnavailable(t *testing.T) {
	now := time.Unix(100, 0)
	facts := map[string]hostFacts{"a": {version: "v1"}, "b": {version: "v1"}, "c": {version: "v1"}, "d": {version: "v1"}}
	ro := pendingRollout(2, "a", "b", "c", "d")

	advance(ro, facts, now)
	assert.Equal(t, []string{"upgrading", "pending", "pending", "pending"}, states(ro), "the canary alone")
	advance(ro, facts, now)
	assert.Equal(t, store.RolloutCanary, ro.State, "nothing moves while the canary is out")

	facts["a"] = hostFacts{version: "v2"}
	advance(ro, facts, now)
	assert.Equal(t, store.RolloutRolling, ro.State)
	assert.Equal(t, []string{"done", "upgrading", "upgrading", "pending"}, states(ro), "a wave of max_unavailable")

	facts["b"] = hostFacts{version: "v2"}
	advance(ro, facts, now)
	assert.Equal(t, []string{"done", "done", "upgrading", "upgrading"}, states(ro), "a slot freed is taken")

	facts["c"], facts["d"] = hostFacts{version: "v2"}, hostFacts{version: "v2"}
	advance(ro, facts, now)
	assert.Equal(t, store.RolloutDone, ro.State)
	assert.Equal(t, uint64(1), ro.Hosts[3].Attempt)
	assert.Equal(t, "v1", ro.Hosts[3].FromVersion)
}

func TestOnlyAFailureOfThisAttemptHaltsTheRollout(t *testing.T) {
	now := time.Unix(100, 0)
	ro := pendingRollout(1, "a", "b")
	facts := map[string]hostFacts{"a": {version: "v1"}, "b": {version: "v1"}}
	advance(ro, facts, now)

	// What the host said of an earlier rollout does not count.
	facts["a"] = hostFacts{version: "v1", upgrade: store.HostUpgrade{Step: UpgradeFailed, RolloutID: "ro-0", Attempt: 1, Error: "old"}}
	advance(ro, facts, now)
	assert.Equal(t, store.RolloutCanary, ro.State)

	facts["a"] = hostFacts{version: "v1", upgrade: store.HostUpgrade{Step: UpgradeFailed, RolloutID: "ro-1", Attempt: 1, Error: "exited at start"}}
	advance(ro, facts, now)
	assert.Equal(t, store.RolloutHalted, ro.State)
	assert.Equal(t, "host a failed to upgrade: exited at start", ro.Reason)
	assert.Equal(t, []string{"failed", "pending"}, states(ro))

	advance(ro, facts, now)
	assert.Equal(t, []string{"failed", "pending"}, states(ro), "a halted rollout starts nobody")
}

func TestAHostThatLeftTheFleetFailsItsPart(t *testing.T) {
	ro := pendingRollout(1, "a")
	advance(ro, map[string]hostFacts{"a": {version: "v1"}}, time.Unix(1, 0))
	advance(ro, map[string]hostFacts{}, time.Unix(2, 0))
	assert.Equal(t, store.RolloutHalted, ro.State)
	assert.Contains(t, ro.Reason, "left the fleet")
}

func TestHumanAge(t *testing.T) {
	assert.Equal(t, "45 s", humanAge(45*time.Second))
	assert.Equal(t, "6 min", humanAge(6*time.Minute+20*time.Second))
	assert.Equal(t, "3 h", humanAge(3*time.Hour))
	assert.Equal(t, "4 days", humanAge(100*time.Hour))
}
