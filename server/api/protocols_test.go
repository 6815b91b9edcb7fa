package api_test

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// The three protocols one port serves; every generated client speaks each.
var protocols = []struct {
	name string
	opt  connect.ClientOption
	// contentType is what a unary answer in this protocol carries.
	contentType string
}{
	{"connect", connect.WithClientOptions(), "application/proto"},
	{"grpc", connect.WithGRPC(), "application/grpc"},
	{"grpc-web", connect.WithGRPCWeb(), "application/grpc-web+proto"},
}

// family holds a client of every user-facing service, in one protocol, as
// one caller.
type family struct {
	vms       eitriv1connect.VMServiceClient
	hosts     eitriv1connect.HostServiceClient
	exposures eitriv1connect.ExposureServiceClient
	tokens    eitriv1connect.TokenServiceClient
	quotas    eitriv1connect.QuotaServiceClient
}

func (e *env) family(protocol connect.ClientOption, tok string) family {
	opts := []connect.ClientOption{protocol, bearer(tok)}
	return family{
		vms:       eitriv1connect.NewVMServiceClient(e.http, e.url, opts...),
		hosts:     eitriv1connect.NewHostServiceClient(e.http, e.url, opts...),
		exposures: eitriv1connect.NewExposureServiceClient(e.http, e.url, opts...),
		tokens:    eitriv1connect.NewTokenServiceClient(e.http, e.url, opts...),
		quotas:    eitriv1connect.NewQuotaServiceClient(e.http, e.url, opts...),
	}
}

// recv returns a stream's next message, failing the test when it ends.
func recv[T any](t *testing.T, st *connect.ServerStreamForClient[T]) *T {
	t.Helper()
	require.True(t, st.Receive(), "stream ended: %v", st.Err())
	return st.Msg()
}

// Every RPC of every user-facing family, the Watch streams and the agent's
// Enroll and Sync, over Connect, gRPC and gRPC-Web with the generated
// clients against a real HTTP/2 server; the errors arrive with their codes
// and field names in each.
func TestEveryRPCFamilyOverEveryProtocol(t *testing.T) {
	for _, p := range protocols {
		t.Run(p.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			e := newEnv(t)
			c := e.family(p.opt, e.admin)

			// Hosts: a join token, the agent's own service, and the watch.
			hw, err := c.hosts.WatchHosts(ctx, connect.NewRequest(&eitriv1.WatchHostsRequest{}))
			require.NoError(t, err)
			defer hw.Close()
			assert.Empty(t, recv(t, hw).GetSnapshot().GetHosts())
			jt, err := c.hosts.CreateJoinToken(ctx, connect.NewRequest(&eitriv1.CreateJoinTokenRequest{}))
			require.NoError(t, err)
			agentOpts := []connect.ClientOption{p.opt}
			enrolled, err := eitriv1connect.NewAgentServiceClient(e.http, e.url, agentOpts...).
				Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: jt.Msg.Token, Hostname: "h1"}))
			require.NoError(t, err)
			hostID := enrolled.Msg.HostId
			assert.Equal(t, hostID, recv(t, hw).GetChanged().GetId(), "the watch sees the host enroll")

			sync := eitriv1connect.NewAgentServiceClient(e.http, e.url, append(agentOpts, bearer(enrolled.Msg.HostCredential))...).Sync(ctx)
			defer func() { _ = sync.CloseRequest(); _ = sync.CloseResponse() }()
			require.NoError(t, sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: &eitriv1.Hello{AgentVersion: "test", Address: "192.0.2.10", Accelerator: "tcg"}}}))
			first, err := sync.Receive()
			require.NoError(t, err)
			assert.Empty(t, first.GetSnapshot().GetVms())
			require.NoError(t, sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Report{Report: &eitriv1.ActualStateReport{Capacity: big()}}}))
			for h := recv(t, hw).GetChanged(); h.GetCapacity().GetVcpus() == 0; h = recv(t, hw).GetChanged() {
			}
			hosts, err := c.hosts.ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
			require.NoError(t, err)
			require.Len(t, hosts.Msg.Hosts, 1)
			got, err := c.hosts.GetHost(ctx, connect.NewRequest(&eitriv1.GetHostRequest{Id: hostID}))
			require.NoError(t, err)
			assert.True(t, got.Msg.Host.Connected)

			// VMs: the whole life, seen on the watch.
			vw, err := c.vms.WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
			require.NoError(t, err)
			defer vw.Close()
			assert.Empty(t, recv(t, vw).GetSnapshot().GetVms())
			created, err := c.vms.CreateVM(ctx, connect.NewRequest(createReq("web-1")))
			require.NoError(t, err)
			id := created.Msg.Vm.Id
			assert.Equal(t, id, recv(t, vw).GetChanged().GetId())
			_, err = c.vms.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
			require.NoError(t, err)
			list, err := c.vms.ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
			require.NoError(t, err)
			assert.Len(t, list.Msg.Vms, 1)
			assert.Equal(t, p.contentType, list.Header().Get("Content-Type"), "answered in the protocol asked")
			stopped, err := c.vms.StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: id}))
			require.NoError(t, err)
			assert.Equal(t, "stopped", stopped.Msg.Vm.PowerState)
			started, err := c.vms.StartVM(ctx, connect.NewRequest(&eitriv1.StartVMRequest{Id: id}))
			require.NoError(t, err)
			assert.Equal(t, "running", started.Msg.Vm.PowerState)
			events, err := c.vms.ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: id}))
			require.NoError(t, err)
			assert.NotEmpty(t, events.Msg.Events)
			_, err = c.vms.RetryVM(ctx, connect.NewRequest(&eitriv1.RetryVMRequest{Id: id}))
			assert.Equal(t, connect.CodeFailedPrecondition, code(err), "only a failed create is retried")
			orphans, err := c.vms.ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
			require.NoError(t, err)
			assert.Empty(t, orphans.Msg.Vms)
			_, err = c.vms.AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: hostID, VmId: "vm-nope"}))
			assert.Equal(t, connect.CodeNotFound, code(err))
			_, err = c.vms.DestroyOrphanedVM(ctx, connect.NewRequest(&eitriv1.DestroyOrphanedVMRequest{HostId: hostID, VmId: "vm-nope"}))
			assert.Equal(t, connect.CodeNotFound, code(err))

			// Exposures, seen on their watch.
			xw, err := c.exposures.WatchExposures(ctx, connect.NewRequest(&eitriv1.WatchExposuresRequest{}))
			require.NoError(t, err)
			defer xw.Close()
			assert.Empty(t, recv(t, xw).GetSnapshot().GetExposures())
			x, err := c.exposures.CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{VmId: id, GuestPort: 80}))
			require.NoError(t, err)
			assert.Equal(t, x.Msg.Exposure.Id, recv(t, xw).GetChanged().GetId())
			xs, err := c.exposures.ListExposures(ctx, connect.NewRequest(&eitriv1.ListExposuresRequest{VmId: id}))
			require.NoError(t, err)
			assert.Len(t, xs.Msg.Exposures, 1)
			_, err = c.exposures.DeleteExposure(ctx, connect.NewRequest(&eitriv1.DeleteExposureRequest{Id: x.Msg.Exposure.Id}))
			require.NoError(t, err)
			assert.Equal(t, x.Msg.Exposure.Id, recv(t, xw).GetRemovedId())

			deleted, err := c.vms.DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: id}))
			require.NoError(t, err)
			assert.True(t, deleted.Msg.Vm.Deleted)
			restored, err := c.vms.RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: id}))
			require.NoError(t, err)
			assert.False(t, restored.Msg.Vm.Deleted)

			// Tokens and sessions.
			tok, err := c.tokens.CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "ci", UserName: "bob"}))
			require.NoError(t, err)
			toks, err := c.tokens.ListTokens(ctx, connect.NewRequest(&eitriv1.ListTokensRequest{}))
			require.NoError(t, err)
			assert.GreaterOrEqual(t, len(toks.Msg.Tokens), 2)
			e.session(e.admin)
			sessions, err := c.tokens.ListSessions(ctx, connect.NewRequest(&eitriv1.ListSessionsRequest{}))
			require.NoError(t, err)
			require.Len(t, sessions.Msg.Sessions, 1)
			_, err = c.tokens.RevokeSession(ctx, connect.NewRequest(&eitriv1.RevokeSessionRequest{Id: sessions.Msg.Sessions[0].Id}))
			require.NoError(t, err)

			// Quotas, as bob (his own) and as the admin (setting his).
			bob := e.family(p.opt, tok.Msg.Secret)
			q, err := bob.quotas.GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{}))
			require.NoError(t, err)
			assert.Equal(t, "bob", q.Msg.Quota.UserName)
			five := int64(5)
			set, err := c.quotas.SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{UserName: "bob", Limits: &eitriv1.QuotaLimits{Vms: &five}}))
			require.NoError(t, err)
			assert.Equal(t, five, set.Msg.Quota.Effective.GetVms())
			_, err = bob.quotas.SetQuota(ctx, connect.NewRequest(&eitriv1.SetQuotaRequest{Defaults: true, Limits: &eitriv1.QuotaLimits{Vms: &five}}))
			assert.Equal(t, connect.CodePermissionDenied, code(err))
			_, err = c.tokens.RevokeToken(ctx, connect.NewRequest(&eitriv1.RevokeTokenRequest{Id: tok.Msg.Token.Id}))
			require.NoError(t, err)
			_, err = bob.vms.ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
			assert.Equal(t, connect.CodeUnauthenticated, code(err), "a revoked token")

			// Errors keep their code and name the field in every protocol.
			bad := createReq("Web_2")
			_, err = c.vms.CreateVM(ctx, connect.NewRequest(bad))
			require.Equal(t, connect.CodeInvalidArgument, code(err))
			assert.Contains(t, err.Error(), "name:")

			// A host with a VM is not decommissioned.
			_, err = c.hosts.DecommissionHost(ctx, connect.NewRequest(&eitriv1.DecommissionHostRequest{Id: hostID}))
			assert.Equal(t, connect.CodeFailedPrecondition, code(err))
		})
	}
}
