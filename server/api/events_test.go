package api_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/server/store"
)

// Anyone who can open tunnels to a VM can make it events by the thousand
// (one reply would be megabytes), so a VM keeps its newest
// store.MaxVMEvents events and the list comes in pages, the newest first.
func TestAFloodedTimelineIsKeptShortAndListedInPages(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	hostID, cred := e.enroll("h1")
	e.connect(hostID, cred, big())
	id := e.mustCreateVM(e.admin, createReq("web-1")).Id

	const flood = store.MaxVMEvents + 500
	pad := strings.Repeat("x", 1000)
	start := time.Now() // after the "created" event, which the flood pushes out
	for i := range flood {
		require.NoError(t, e.srv.Store.AddVMEvent(ctx, store.VMEvent{VMID: id, At: start.Add(time.Duration(i) * time.Millisecond),
			Kind: "tunnel", Message: fmt.Sprintf("tunnel %d %s", i, pad)}))
	}
	list := func(size int32, token string) (*eitriv1.ListVMEventsResponse, error) {
		r, err := e.vms(e.admin).ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: id, PageSize: size, PageToken: token}))
		if err != nil {
			return nil, err
		}
		return r.Msg, nil
	}

	first, err := list(0, "")
	require.NoError(t, err)
	require.Len(t, first.Events, fleet.DefaultVMEventsPage, "a request that names no size gets the default page")
	assert.True(t, strings.HasPrefix(first.Events[len(first.Events)-1].Message, fmt.Sprintf("tunnel %d ", flood-1)),
		"the first page ends with the newest event")
	assert.Less(t, proto.Size(first), 150<<10, "one reply stays small")
	assert.NotEmpty(t, first.NextPageToken)

	// Every page, walked back from the newest, is the whole timeline once,
	// oldest first, and only the newest MaxVMEvents of it.
	var all []string
	tok := ""
	pages := 0
	for {
		p, err := list(300, tok)
		require.NoError(t, err)
		pages++
		var msgs []string
		for _, ev := range p.Events {
			msgs = append(msgs, strings.TrimSuffix(ev.Message, " "+pad))
		}
		all = append(msgs, all...)
		if p.NextPageToken == "" {
			break
		}
		tok = p.NextPageToken
		require.Less(t, pages, 10, "the pages end")
	}
	assert.Equal(t, 4, pages, "1,000 events in pages of 300")
	require.Len(t, all, store.MaxVMEvents)
	for i, m := range all {
		require.Equal(t, fmt.Sprintf("tunnel %d", flood-store.MaxVMEvents+i), m)
	}

	big, err := list(5000, "")
	require.NoError(t, err)
	assert.Len(t, big.Events, fleet.MaxVMEventsPage, "a size past the largest page gets the largest page")
	assert.Empty(t, big.NextPageToken, "a VM holds no more than one largest page")

	for _, c := range []struct {
		name  string
		size  int32
		token string
		field string
	}{
		{"a negative page size", -1, "", "page_size: "},
		{"a page token no reply gave", 0, "not-a-token", "page_token: "},
		{"a page token made up in the right alphabet", 0, "ZTEuMQ", "page_token: "},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := list(c.size, c.token)
			assert.Equal(t, connect.CodeInvalidArgument, code(err), "%v", err)
			assert.ErrorContains(t, err, c.field)
		})
	}
}

// Console lines a host copies into a VM's events are the guest's words, and
// `eitri vm events` prints them to its user's terminal: they must carry no
// C1 controls (U+0080–U+009F) either, which some terminals obey as escapes
// as they do C0 (a guest's U+009B "CSI 2J" would clear the screen).
func TestConsoleLinesInAVMsEventsCarryNoC1Escapes(t *testing.T) {
	e := newEnv(t)
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	vm := e.mustCreateVM(e.admin, createReq("web-1"))
	a.next(t)

	const escapes = "\u009b2J\u009d0;owned\u009c\u0085\x1b[31m\x07"
	exit := &eitriv1.GuestExit{Reason: "qemu exited (signal 9)" + escapes, SerialTail: "login: " + escapes + "\nkernel panic"}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{{VmId: vm.Id, Power: "stopped", Phase: "failed",
		LastError: "guest died: " + escapes, UnexpectedExits: 1, LastExit: exit}}})
	e.vmIs(vm.Id, "failed")
	// The exit is recorded before the status change that follows it, so wait
	// for both: reading between the two finds no status event yet.
	require.Eventually(t, func() bool {
		evs := e.events(vm.Id)
		return len(eventsOfKind(evs, "exited")) == 1 && len(eventsOfKind(evs, "status")) > 0
	}, 5*time.Second, 5*time.Millisecond)

	exited := eventsOfKind(e.events(vm.Id), "exited")[0].Message
	assert.Equal(t, "qemu exited (signal 9)2J0;owned[31m; serial console:\nlogin: 2J0;owned[31m\nkernel panic", exited)
	status := eventsOfKind(e.events(vm.Id), "status")
	require.NotEmpty(t, status)
	for _, ev := range append(e.events(vm.Id), &eitriv1.VMEvent{Message: e.vmIs(vm.Id, "failed").LastError}) {
		assert.False(t, strings.ContainsFunc(ev.Message, func(r rune) bool { return r >= 0x80 && r <= 0x9f || r == 0x1b || r == 0x07 }),
			"%s: %q", ev.Kind, ev.Message)
	}
}
