package main

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/store"
)

// One user opening and dropping tunnels to a stopped VM must not write an
// event for each (thousands in seconds, pushing every other event out of
// the VM's timeline): the first ten a minute are recorded one by one and
// the rest counted (into one event at the end of the minute, which the
// fleet's own tests read).
func TestAFloodOfRefusedTunnelsWritesTenEventsAMinuteNotOneEach(t *testing.T) {
	e := newTunnelEnv(t, server.Config{})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	e.guest.run(e.vmID, false)
	port := uint32(hostFreePort(t))

	const attempts = 300
	for range attempts {
		_, err := openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: port})
		require.Equal(t, connect.CodeFailedPrecondition, connect.CodeOf(err), "%v", err)
	}
	// OpenTunnel records a tunnel before it answers, so every attempt has
	// been heard by now.
	evs := e.events(t, "tunnel")
	require.Equal(t, 10, len(evs), "ten recorded one by one, the rest counted")
	for _, ev := range evs {
		assert.True(t, strings.Contains(ev, "failed: vm "+e.vmID+" is not running"), ev)
	}

	// A tunnel later in the minute still works; it too is only counted.
	e.guest.run(e.vmID, true)
	echo := serveTCP(t, echoUntilEOF)
	st, err := openTunnel(ctx, e.vms, &eitriv1.OpenTunnelRequest{VmId: e.vmID, Port: echo, Data: []byte("hi")})
	require.NoError(t, err)
	require.NoError(t, st.CloseRequest())
	got, _, err := readTunnel(st)
	require.NoError(t, err)
	assert.Equal(t, "hi[2 bytes]", got)
	assert.Equal(t, 10, len(e.events(t, "tunnel")))
}

// ListVMEvents answers a page at a time; `eitri vm events` still shows
// the whole timeline, oldest first.
func TestEitriVMEventsShowsTheWholeTimelineOldestFirst(t *testing.T) {
	e := newTunnelEnv(t, server.Config{})
	ctx := context.Background()
	const n = 250 // more than the API's default page
	start := time.Now()
	for i := range n {
		require.NoError(t, e.srv.Store.AddVMEvent(ctx, store.VMEvent{VMID: e.vmID, At: start.Add(time.Duration(i) * time.Millisecond),
			Kind: "note", Message: fmt.Sprintf("note %d", i)}))
	}
	out, err := e.eitri("vm", "events", "web-1", "-o", "json")
	require.NoError(t, err)
	var r eitriv1.ListVMEventsResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &r))
	var notes []string
	for _, ev := range r.Events {
		if ev.Kind == "note" {
			notes = append(notes, ev.Message)
		}
	}
	require.Len(t, notes, n)
	for i, m := range notes {
		require.Equal(t, fmt.Sprintf("note %d", i), m)
	}
	assert.Equal(t, "created", r.Events[0].Kind, "the oldest event comes first")
	assert.Empty(t, r.NextPageToken)

	table, err := e.eitri("vm", "events", "web-1")
	require.NoError(t, err)
	assert.True(t, strings.HasSuffix(strings.TrimSpace(table), fmt.Sprintf("note %d", n-1)), "the newest event comes last")
}
