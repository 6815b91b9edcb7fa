package syncclient

import (
	"context"
	"errors"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// frameServer is a control plane that answers hello with a snapshot and
// hands the test every frame after it, one stream at a time; hangup ends
// the current stream.
type frameServer struct {
	eitriv1connect.UnimplementedAgentServiceHandler
	frames chan *eitriv1.SyncRequest
	hangup chan struct{}
}

func (s *frameServer) Sync(ctx context.Context, st *connect.BidiStream[eitriv1.SyncRequest, eitriv1.SyncResponse]) error {
	if _, err := st.Receive(); err != nil {
		return err
	}
	if err := st.Send(&eitriv1.SyncResponse{Msg: &eitriv1.SyncResponse_Snapshot{Snapshot: &eitriv1.DesiredStateSnapshot{Generation: 1}}}); err != nil {
		return err
	}
	got := make(chan *eitriv1.SyncRequest)
	go func() {
		for {
			m, err := st.Receive()
			if err != nil {
				close(got)
				return
			}
			got <- m
		}
	}()
	for {
		select {
		case <-s.hangup:
			return errors.New("hung up by the test")
		case m, ok := <-got:
			if !ok {
				return nil
			}
			s.frames <- m
		case <-ctx.Done():
			return nil
		}
	}
}

type quietSource struct{}

func (quietSource) Apply(*eitriv1.DesiredStateSnapshot) bool { return true }
func (quietSource) Fill(*eitriv1.ActualStateReport)          {}

func TestTheImageCacheIsSentOnConnectAndOnChangeNotWithEveryReport(t *testing.T) {
	srv := &frameServer{frames: make(chan *eitriv1.SyncRequest, 1024), hangup: make(chan struct{})}
	_, h := eitriv1connect.NewAgentServiceHandler(srv)
	ts := httptest.NewUnstartedServer(h)
	ts.EnableHTTP2 = true
	ts.StartTLS()
	defer ts.Close()

	var built atomic.Int64
	changed := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_ = Run(ctx, Config{
			Identity: state.Identity{ServerURL: ts.URL}, Client: ts.Client(), Source: quietSource{},
			Hello:       func() *eitriv1.Hello { return &eitriv1.Hello{} },
			ReportEvery: 20 * time.Millisecond, Heartbeat: 20 * time.Millisecond, MinBackoff: 10 * time.Millisecond,
			ImageCache: func() *eitriv1.ImageCacheReport {
				built.Add(1)
				return &eitriv1.ImageCacheReport{TotalBytes: 42}
			},
			ImageCacheChanged: changed,
		})
	}()

	// count reads frames until n reports have arrived.
	count := func(n int) (caches int) {
		t.Helper()
		for reports := 0; reports < n; {
			select {
			case m := <-srv.frames:
				switch {
				case m.GetReport() != nil:
					reports++
				case m.GetImageCache() != nil:
					assert.Equal(t, uint64(42), m.GetImageCache().GetTotalBytes())
					caches++
				}
			case <-time.After(5 * time.Second):
				t.Fatalf("only %d reports arrived", reports)
			}
		}
		return caches
	}

	assert.Equal(t, 1, count(10), "one listing after connecting, however many heartbeats follow")

	for range 5 {
		select {
		case changed <- struct{}{}:
		default:
		}
	}
	got := count(5)
	assert.GreaterOrEqual(t, got, 1, "a change is sent")
	assert.LessOrEqual(t, got, 2, "changes in a burst are coalesced")
	assert.Equal(t, 0, count(5), "and then nothing until the next change")

	srv.hangup <- struct{}{}
	assert.Equal(t, 1, count(5), "a new stream gets the listing again")
	assert.LessOrEqual(t, built.Load(), int64(4), "the listing is built only when it is sent")
}
