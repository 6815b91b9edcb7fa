package store

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// withTwoVMs opens a store on e holding fixture's users and hosts and
// u1's VMs v1 ("web") and v2 ("db") on h1.
func withTwoVMs(t *testing.T, e engine) *Store {
	t.Helper()
	s, _ := e.open(t)
	fixture(t, s)
	mustCreateVM(t, s, testVM("v1", "u1", "h1", "web", t0))
	mustCreateVM(t, s, testVM("v2", "u1", "h1", "db", t0))
	return s
}

func messages(evs []VMEvent) []string {
	out := make([]string, len(evs))
	for i, e := range evs {
		out[i] = e.Message
	}
	return out
}

func TestAddingPastTheCapDropsTheVMsOldestEventsAndNoOtherVMs(t *testing.T) {
	eachEngine(t, testAddingPastTheCapDropsTheVMsOldestEventsAndNoOtherVMs)
}

func testAddingPastTheCapDropsTheVMsOldestEventsAndNoOtherVMs(t *testing.T, e engine) {
	s := withTwoVMs(t, e)
	ctx := context.Background()
	require.NoError(t, s.addVMEvent(ctx, VMEvent{VMID: "v2", At: t0, Kind: "k", Message: "v2 first"}, 3))
	require.NoError(t, s.addVMEvent(ctx, VMEvent{VMID: "v2", At: t0, Kind: "k", Message: "v2 second"}, 3))

	// "late" is written last but happened first: it is the oldest, so it
	// is the first to go. "b" and "c" share an instant; id breaks the tie.
	for _, e := range []VMEvent{
		{At: t0.Add(2 * time.Second), Message: "a"},
		{At: t0.Add(3 * time.Second), Message: "b"},
		{At: t0.Add(3 * time.Second), Message: "c"},
		{At: t0.Add(time.Second), Message: "late"},
		{At: t0.Add(4 * time.Second), Message: "d"},
	} {
		e.VMID, e.Kind = "v1", "k"
		require.NoError(t, s.addVMEvent(ctx, e, 3))
	}

	evs, err := s.ListVMEvents(ctx, "v1")
	require.NoError(t, err)
	assert.Equal(t, []string{"b", "c", "d"}, messages(evs), "the newest three, oldest first")
	evs, err = s.ListVMEvents(ctx, "v2")
	require.NoError(t, err)
	assert.Equal(t, []string{"v2 first", "v2 second"}, messages(evs))
}

func TestAFloodOfEventsLeavesAVMWithMaxVMEvents(t *testing.T) {
	eachEngine(t, testAFloodOfEventsLeavesAVMWithMaxVMEvents)
}

func testAFloodOfEventsLeavesAVMWithMaxVMEvents(t *testing.T, e engine) {
	s := withTwoVMs(t, e)
	ctx := context.Background()
	const extra = 25
	for i := range MaxVMEvents + extra {
		require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v1", At: t0.Add(time.Duration(i) * time.Millisecond), Kind: "tunnel", Message: fmt.Sprint(i)}))
	}
	evs, err := s.ListVMEvents(ctx, "v1")
	require.NoError(t, err)
	require.Len(t, evs, MaxVMEvents)
	assert.Equal(t, fmt.Sprint(extra), evs[0].Message, "the oldest kept is the first one not pushed out")
	assert.Equal(t, fmt.Sprint(MaxVMEvents+extra-1), evs[len(evs)-1].Message)
}

func TestEventPagesWalkBackFromTheNewestEachOldestFirst(t *testing.T) {
	eachEngine(t, testEventPagesWalkBackFromTheNewestEachOldestFirst)
}

func testEventPagesWalkBackFromTheNewestEachOldestFirst(t *testing.T, e engine) {
	s := withTwoVMs(t, e)
	ctx := context.Background()
	// Pairs share an instant, so a page boundary falls between two events
	// of one instant.
	for i := range 7 {
		at := t0.Add(time.Duration(i/2) * time.Second)
		require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v1", At: at, Kind: "k", Message: fmt.Sprint(i)}))
		require.NoError(t, s.AddVMEvent(ctx, VMEvent{VMID: "v2", At: at, Kind: "k", Message: "other"}))
	}

	var pages [][]string
	var before *VMEventCursor
	for range 10 {
		evs, err := s.ListVMEventsBefore(ctx, "v1", before, 3)
		require.NoError(t, err)
		if len(evs) == 0 {
			break
		}
		pages = append(pages, messages(evs))
		before = &VMEventCursor{At: evs[0].At, ID: evs[0].ID}
	}
	assert.Equal(t, [][]string{{"4", "5", "6"}, {"1", "2", "3"}, {"0"}}, pages)
}
