package reconcile

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/permanent"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestAdmissionRule(t *testing.T) {
	host := Resources{VCPUs: 2, MemMB: 4096, DiskGB: 100}
	for _, c := range []struct {
		name       string
		held, need Resources
		refused    string // "" when admitted
	}{
		{"an empty host takes a VM", Resources{}, Resources{VCPUs: 1, MemMB: 1024, DiskGB: 10}, ""},
		{"memory may be filled exactly", Resources{MemMB: 3072}, Resources{VCPUs: 1, MemMB: 1024, DiskGB: 1}, ""},
		{"memory is never overcommitted", Resources{MemMB: 2048}, Resources{VCPUs: 1, MemMB: 4096, DiskGB: 1},
			"host has 2048 MiB free for guests; vm needs 4096 MiB (admission check)"},
		{"memory held beyond capacity leaves none free", Resources{MemMB: 5000}, Resources{VCPUs: 1, MemMB: 1, DiskGB: 1},
			"host has 0 MiB free for guests; vm needs 1 MiB (admission check)"},
		{"disk may be filled exactly", Resources{DiskGB: 90}, Resources{VCPUs: 1, MemMB: 1, DiskGB: 10}, ""},
		{"disk is never overcommitted", Resources{DiskGB: 95}, Resources{VCPUs: 1, MemMB: 1, DiskGB: 10},
			"host has 5 GiB of disk free for guests; vm needs 10 GiB (admission check)"},
		{"vCPUs may be overcommitted four times", Resources{VCPUs: 6}, Resources{VCPUs: 2, MemMB: 1, DiskGB: 1}, ""},
		{"but no further", Resources{VCPUs: 7}, Resources{VCPUs: 2, MemMB: 1, DiskGB: 1},
			"host has 1 vCPUs free for guests (2 CPUs, 4x overcommit, 7 vCPUs in use); vm needs 2 (admission check)"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := admit(host, c.held, c.need)
			if c.refused == "" {
				assert.NoError(t, err)
				return
			}
			require.EqualError(t, err, c.refused)
			assert.True(t, permanent.Is(err), "a refusal is not retried")
		})
	}
}

// withCapacity measures the fixture's host as c; fetches counts image fetches.
func withCapacity(c *Resources, fetches *atomic.Int32) func(*Config) {
	return func(cfg *Config) {
		cfg.Capacity = func() (Resources, error) { return *c, nil }
		cfg.Images = unpinned(func(context.Context, string, string, func(int64, int64)) (string, error) {
			fetches.Add(1)
			return "/cache/x.raw", nil
		})
	}
}

func sized(d *eitriv1.VMDesired, memMB, diskGB int64) *eitriv1.VMDesired {
	d.MemMb, d.DiskGb = memMB, diskGB
	return d
}

func TestAVMThatDoesNotFitFailsAtOnceBeforeAnyDownload(t *testing.T) {
	capacity := Resources{VCPUs: 2, MemMB: 4096, DiskGB: 100}
	var fetches atomic.Int32
	f := setup(t, withCapacity(&capacity, &fetches))
	big := sized(vm("big"), 4096, 1)
	f.apply(snap(1, sized(vm("vm1"), 2048, 1)))
	require.Equal(t, "ready", f.row("vm1").GetPhase())

	rep := f.apply(snap(2, sized(vm("vm1"), 2048, 1), big))
	row := findVM(rep, "big")
	assert.Equal(t, "failed", row.GetPhase())
	assert.Equal(t, "host has 2048 MiB free for guests; vm needs 4096 MiB (admission check)", row.GetLastError())
	assert.Equal(t, int32(1), fetches.Load(), "only vm1's image was fetched")
	assert.Equal(t, 1, f.record("big").CreateAttempts, "failed at once")
	assert.True(t, f.record("big").Failed)

	preflights := f.hv.count("preflight")
	f.apply(snap(3, sized(vm("vm1"), 2048, 1), sized(vm("big"), 4096, 2)))
	assert.Equal(t, preflights, f.hv.count("preflight"), "a failed create is not tried again unasked")
	assert.Equal(t, int32(1), fetches.Load())
}

func TestAVMThatFitsProceeds(t *testing.T) {
	capacity := Resources{VCPUs: 1, MemMB: 2048, DiskGB: 10}
	var fetches atomic.Int32
	f := setup(t, withCapacity(&capacity, &fetches))
	rep := f.apply(snap(1, sized(vm("vm1"), 1024, 5), sized(vm("vm2"), 1024, 5)))
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase(), findVM(rep, "vm1").GetLastError())
	assert.Equal(t, "ready", findVM(rep, "vm2").GetPhase(), findVM(rep, "vm2").GetLastError())
	assert.Equal(t, int32(2), fetches.Load())
}

// Creates in flight together are judged one after another: of two that
// each fit alone but not both, exactly one is admitted.
func TestConcurrentCreatesCannotBothTakeTheLastRoom(t *testing.T) {
	capacity := Resources{VCPUs: 4, MemMB: 3072, DiskGB: 100}
	var fetches atomic.Int32
	f := setup(t, withCapacity(&capacity, &fetches))
	rep := f.apply(snap(1, sized(vm("a"), 2048, 1), sized(vm("b"), 2048, 1)))
	phases := []string{findVM(rep, "a").GetPhase(), findVM(rep, "b").GetPhase()}
	assert.ElementsMatch(t, []string{"ready", "failed"}, phases)
	assert.Equal(t, int32(1), fetches.Load())
}

// A stopped VM gives its memory back but keeps its disk.
func TestAStoppedVMHoldsOnlyItsDisk(t *testing.T) {
	capacity := Resources{VCPUs: 2, MemMB: 2048, DiskGB: 60}
	var fetches atomic.Int32
	f := setup(t, withCapacity(&capacity, &fetches))
	off := stopped(sized(vm("off"), 2048, 50))
	f.apply(snap(1, off))
	require.Equal(t, "stopped", f.row("off").GetPhase())

	rep := f.apply(snap(2, off, sized(vm("fits"), 2048, 5)))
	assert.Equal(t, "ready", findVM(rep, "fits").GetPhase(), findVM(rep, "fits").GetLastError())
	rep = f.apply(snap(3, off, sized(vm("fits"), 2048, 5), sized(vm("nodisk"), 0, 10)))
	assert.Equal(t, "host has 5 GiB of disk free for guests; vm needs 10 GiB (admission check)", findVM(rep, "nodisk").GetLastError())
}

// A VM already running is never refused, even by a host that now measures
// smaller than what it holds; and what it holds still counts against new
// creates.
func TestAnAdoptedRunningVMIsNeverRefused(t *testing.T) {
	capacity := Resources{VCPUs: 2, MemMB: 4096, DiskGB: 100}
	var fetches atomic.Int32
	f := setup(t, withCapacity(&capacity, &fetches))
	f.apply(snap(1, sized(vm("vm1"), 4096, 1)))
	require.Equal(t, "ready", f.row("vm1").GetPhase())
	f.eng.Close()

	capacity = Resources{VCPUs: 1, MemMB: 1024, DiskGB: 100}
	f2 := setupOn(t, f.st, f.hv, withCapacity(&capacity, &fetches))
	rep := f2.apply(snap(2, sized(vm("vm1"), 4096, 1), sized(vm("vm2"), 256, 1)))
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase(), findVM(rep, "vm1").GetLastError())
	assert.Equal(t, 1, f.hv.count("boot"), "the running guest was adopted, not booted again")
	assert.Equal(t, "host has 0 MiB free for guests; vm needs 256 MiB (admission check)", findVM(rep, "vm2").GetLastError())
}
