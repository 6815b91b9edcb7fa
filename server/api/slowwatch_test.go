package api_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// A console that stops reading (a laptop lid closed, a tab frozen) must not
// hold anybody else up: while it reads nothing for 30 s, another watcher
// gets every round of narration, and the stuck one is cut off after the
// bound instead of queueing without end.
func TestAWatcherThatReadsNothingFor30sIsCutOffAndSlowsNobody(t *testing.T) {
	if testing.Short() {
		t.Skip("reads nothing for 30 s")
	}
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	var ids []string
	for i := range 3 {
		r, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(createReq(fmt.Sprintf("web-%d", i))))
		require.NoError(t, err)
		ids = append(ids, r.Msg.GetVm().GetId())
	}

	// The stuck console: its own connection, with small HTTP/2 windows so
	// the server's writes block after a few KiB rather than a few MiB, and
	// it never reads a byte.
	tr := e.http.Transport.(*http.Transport).Clone()
	tr.Protocols = new(http.Protocols)
	tr.Protocols.SetHTTP2(true)
	tr.HTTP2 = &http.HTTP2Config{MaxReceiveBufferPerConnection: 64 << 10, MaxReceiveBufferPerStream: 64 << 10}
	defer tr.CloseIdleConnections()
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	stuck, err := eitriv1connect.NewVMServiceClient(&http.Client{Transport: tr}, e.url, bearer(e.admin)).
		WatchVMs(sctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	defer stuck.Close()

	// The attentive console reads everything.
	live, err := e.vms(e.admin).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	require.NoError(t, err)
	defer live.Close()
	var mu sync.Mutex
	seen := map[string]string{}
	go func() {
		for live.Receive() {
			if v := live.Msg().GetChanged(); v != nil {
				mu.Lock()
				seen[v.GetId()] = v.GetStatusDetail()
				mu.Unlock()
			}
		}
	}()
	require.Eventually(t, func() bool { return e.srv.Fleet.VMs.Watchers() == 2 }, 5*time.Second, 10*time.Millisecond)

	// 30 s of narration, each VM a new long line every round; every round
	// reaches the attentive watcher before the next one is sent.
	pad := strings.Repeat("·", 200)
	start := time.Now()
	rounds := 0
	for ; time.Since(start) < 30*time.Second; rounds++ {
		rep := &eitriv1.ActualStateReport{Capacity: big()}
		want := fmt.Sprintf("downloading image %s round %d", pad, rounds)
		for _, id := range ids {
			rep.Vms = append(rep.Vms, &eitriv1.ActualVM{VmId: id, Power: "running", Phase: "creating", StatusDetail: want})
		}
		a.report(t, rep)
		require.Eventually(t, func() bool {
			mu.Lock()
			defer mu.Unlock()
			for _, id := range ids {
				if seen[id] != want {
					return false
				}
			}
			return true
		}, 5*time.Second, time.Millisecond, "round %d reaches the attentive watcher while the other reads nothing", rounds)
		time.Sleep(10 * time.Millisecond)
	}
	t.Logf("%d rounds of narration in 30 s", rounds)

	// The stuck watcher was cut off (its server side is gone) ...
	require.Eventually(t, func() bool { return e.srv.Fleet.VMs.Watchers() == 1 }, 5*time.Second, 10*time.Millisecond,
		"a watcher that read nothing for 30 s is cut off after the bound")
	// ... and reading now gets what was in flight, then an error: never the
	// latest round, which it would have had were it still served.
	last := ""
	for stuck.Receive() {
		if v := stuck.Msg().GetChanged(); v != nil {
			last = v.GetStatusDetail()
		}
	}
	require.Error(t, stuck.Err(), "the stream ends in an error, so the console reconnects for a fresh list")
	assert.NotContains(t, last, fmt.Sprintf("round %d", rounds-1))
}
