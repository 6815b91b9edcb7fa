package api_test

import (
	"context"
	"fmt"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// A Watch stream's changes are framed by the control plane itself (one
// write per batch of shared bytes): every protocol and codec a client may
// speak decodes them, several to a batch, as the generated client expects.
func TestWatchChangesDecodeInEveryProtocolAndCodec(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	vm := e.mustCreateVM(e.admin, createReq("web-1"))

	protocols := []struct {
		name string
		opt  []connect.ClientOption
	}{
		{"connect", nil},
		{"grpc", []connect.ClientOption{connect.WithGRPC()}},
		{"grpc-web", []connect.ClientOption{connect.WithGRPCWeb()}},
	}
	codecs := []struct {
		name string
		opt  []connect.ClientOption
	}{
		{"proto", nil},
		{"json", []connect.ClientOption{connect.WithProtoJSON()}},
	}
	type watch struct {
		name string
		msgs <-chan *eitriv1.WatchVMsResponse
	}
	var watches []watch
	for _, p := range protocols {
		for _, c := range codecs {
			opts := append(append([]connect.ClientOption{bearer(e.admin)}, p.opt...), c.opt...)
			st, err := eitriv1connect.NewVMServiceClient(e.http, e.url, opts...).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
			require.NoError(t, err, p.name+"+"+c.name)
			watches = append(watches, watch{p.name + "+" + c.name, collect(t, st)})
		}
	}
	for _, w := range watches {
		until(t, w.msgs, func(m *eitriv1.WatchVMsResponse) bool { return m.GetSnapshot() != nil })
	}

	// Reports in quick succession: the streams carry them in batches of
	// one or more.
	const n = 5
	for i := range n {
		a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{{
			VmId: vm.Id, Power: "stopped", Phase: "creating", StatusDetail: fmt.Sprintf("downloading … %d/%d", i+1, n)}}})
	}
	last := fmt.Sprintf("downloading … %d/%d", n, n)
	for _, w := range watches {
		seen := until(t, w.msgs, func(m *eitriv1.WatchVMsResponse) bool { return m.GetChanged().GetStatusDetail() == last })
		for _, m := range seen {
			v := m.GetChanged()
			require.NotNil(t, v, "%s: %v", w.name, m)
			assert.Equal(t, vm.Id, v.GetId(), w.name)
			assert.Equal(t, "web-1", v.GetName(), w.name)
			assert.Equal(t, vm.ImageSha256, v.GetImageSha256(), w.name)
		}
	}
}
