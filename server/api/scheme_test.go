package api_test

import (
	"context"
	"net/http"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// The scheme in Authorization is case-insensitive everywhere a credential
// is read: the guard and interceptor (unary and streams), the agent's Sync
// stream, and MCP.
func TestTheBearerSchemeIsCaseInsensitive(t *testing.T) {
	e := newEnv(t)
	_, cred := e.enroll("h1")
	for _, scheme := range []string{"Bearer", "bearer", "BEARER", "bEARER"} {
		t.Run(scheme, func(t *testing.T) {
			opt := connect.WithInterceptors(headers{"Authorization": {scheme + " " + e.admin}})
			assert.NoError(t, listVMs(e, opt), "unary")

			w, err := eitriv1connect.NewVMServiceClient(e.http, e.url, opt).WatchVMs(context.Background(), connect.NewRequest(&eitriv1.WatchVMsRequest{}))
			require.NoError(t, err)
			require.True(t, w.Receive(), "stream: %v", w.Err())
			assert.NotNil(t, w.Msg().GetSnapshot())
			_ = w.Close()

			ac := eitriv1connect.NewAgentServiceClient(e.http, e.url, connect.WithInterceptors(headers{"Authorization": {scheme + " " + cred}}))
			sync := ac.Sync(context.Background())
			require.NoError(t, sync.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: &eitriv1.Hello{AgentVersion: "test"}}}))
			_, err = sync.Receive()
			assert.NoError(t, err, "a host credential")
			_ = sync.CloseRequest()
			_ = sync.CloseResponse()

			req, _ := http.NewRequest(http.MethodPost, e.url+"/mcp", strings.NewReader(`{"jsonrpc":"2.0","id":1,"method":"ping"}`))
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Accept", "application/json, text/event-stream")
			req.Header.Set("Authorization", scheme+" "+e.admin)
			resp, err := e.http.Do(req)
			require.NoError(t, err)
			resp.Body.Close()
			assert.NotEqual(t, http.StatusUnauthorized, resp.StatusCode, "MCP")
		})
	}
	for _, header := range []string{"Basic " + e.admin, "Bearer" + e.admin, "Token " + e.admin} {
		err := listVMs(e, connect.WithInterceptors(headers{"Authorization": {header}}))
		assert.Equal(t, connect.CodeUnauthenticated, code(err), "Authorization: %.10q…", header)
	}
}
