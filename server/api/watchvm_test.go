package api_test

import (
	"context"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// A console's VM page watches its VM alone: the starting list is that VM,
// and its neighbours' changes and removals never reach the stream.
func TestWatchVMsWithAnIDSendsThatVMAlone(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice := e.tenant("alice")
	mine := e.mustCreateVM(alice, createReq("mine"))
	other := e.mustCreateVM(alice, createReq("other"))
	gone := e.mustCreateVM(alice, createReq("gone"))

	st, err := e.vms(alice).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{VmId: mine.Id}))
	require.NoError(t, err)
	msgs := collect(t, st)
	first := until(t, msgs, func(m *eitriv1.WatchVMsResponse) bool { return m.GetSnapshot() != nil })
	require.Len(t, first, 1, "the snapshot comes first")
	snap := first[0].GetSnapshot().GetVms()
	require.Len(t, snap, 1)
	assert.Equal(t, mine.Id, snap[0].GetId())

	// The neighbours narrate and one of them goes; then this VM narrates.
	// Everything the stream carried until then is about this VM.
	_, err = e.vms(alice).DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: gone.Id}))
	require.NoError(t, err)
	row := func(id, detail string) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: id, Power: "stopped", Phase: "creating", StatusDetail: detail}
	}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{row(other.Id, "downloading 1/2")}, Destroyed: []string{gone.Id}})
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{row(other.Id, "downloading 2/2"), row(mine.Id, "downloading 1/9")}})
	seen := until(t, msgs, func(m *eitriv1.WatchVMsResponse) bool {
		return m.GetChanged().GetStatusDetail() == "downloading 1/9"
	})
	for _, m := range seen {
		assert.Equal(t, mine.Id, m.GetChanged().GetId(), "only this VM's changes: %v", m)
	}
}

// An id the caller cannot see ends the watch as NotFound, as
// WatchExposures does for its vm_id: another user's VM is as absent as one
// that never was. A malformed id is the caller's mistake, named.
func TestWatchVMsWithAnIDTheCallerCannotSee(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	e.connect(h, cred, big())
	alice, bob := e.tenant("alice"), e.tenant("bob")
	bobs := e.mustCreateVM(bob, createReq("secret"))

	cases := []struct {
		name, who, id string
		want          connect.Code
		field         string
	}{
		{"another user's VM", alice, bobs.Id, connect.CodeNotFound, ""},
		{"no such VM", alice, "vm-does-not-exist", connect.CodeNotFound, ""},
		{"an id too long", alice, strings.Repeat("x", 10000), connect.CodeInvalidArgument, "id"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st, err := e.vms(tc.who).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{VmId: tc.id}))
			if err == nil {
				defer st.Close()
				assert.False(t, st.Receive(), "no message at all, not even an empty list")
				err = st.Err()
			}
			assert.Equal(t, tc.want, code(err), "%v", err)
			assert.NotContains(t, err.Error(), "secret")
			if tc.field != "" {
				assert.Contains(t, err.Error(), tc.field)
			}
		})
	}

	// The admin sees every VM, bob's included.
	st, err := e.vms(e.admin).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{VmId: bobs.Id}))
	require.NoError(t, err)
	defer st.Close()
	require.True(t, st.Receive(), "%v", st.Err())
	require.Len(t, st.Msg().GetSnapshot().GetVms(), 1)
	assert.Equal(t, bobs.Id, st.Msg().GetSnapshot().GetVms()[0].GetId())
}
