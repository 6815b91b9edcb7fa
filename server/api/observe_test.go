package api

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server/metrics"
)

func TestOnlyTheAPIsProceduresAreLabels(t *testing.T) {
	for _, p := range []string{
		eitriv1connect.VMServiceCreateVMProcedure,
		eitriv1connect.AgentServiceSyncProcedure,
		eitriv1connect.ImageServiceAddImageProcedure,
		eitriv1connect.UsageServiceWatchUsageProcedure,
	} {
		assert.Equal(t, p, ProcedureLabel(p))
	}
	for _, p := range []string{"", "/", "/eitri.v1.VMService/Nope", "/eitri.v1.VMService/CreateVM/", "/eitri.v1.VMService/createvm",
		"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", "/metrics"} {
		assert.Equal(t, OtherProcedure, ProcedureLabel(p), p)
	}
}

// BenchmarkObservingUnary is one unary call served in memory, bare and
// with the metrics interceptor: the difference is what observing costs a
// call.
func BenchmarkObservingUnary(b *testing.B) {
	body, err := proto.Marshal(&eitriv1.GetVMRequest{Id: "vm-1"})
	require.NoError(b, err)
	get := func(_ context.Context, _ *connect.Request[eitriv1.GetVMRequest]) (*connect.Response[eitriv1.GetVMResponse], error) {
		return connect.NewResponse(&eitriv1.GetVMResponse{}), nil
	}
	for _, c := range []struct {
		name string
		opts []connect.HandlerOption
	}{
		{"bare", nil},
		{"observed", []connect.HandlerOption{connect.WithInterceptors(observing{metrics.NewSelf()})}},
	} {
		b.Run(c.name, func(b *testing.B) {
			h := connect.NewUnaryHandler(eitriv1connect.VMServiceGetVMProcedure, get, c.opts...)
			b.ReportAllocs()
			for b.Loop() {
				req := httptest.NewRequest(http.MethodPost, eitriv1connect.VMServiceGetVMProcedure, bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/proto")
				w := httptest.NewRecorder()
				h.ServeHTTP(w, req)
				if w.Code != http.StatusOK {
					b.Fatalf("status %d: %s", w.Code, w.Body)
				}
			}
		})
	}
}

// BenchmarkObserverPerCall is the interceptor's own work on one call: the
// label lookup, the clock and the counter and histogram updates.
func BenchmarkObserverPerCall(b *testing.B) {
	self := metrics.NewSelf()
	b.ReportAllocs()
	for b.Loop() {
		start := time.Now()
		self.Finished(ProcedureLabel(eitriv1connect.VMServiceGetVMProcedure), true, nil, time.Since(start))
	}
}
