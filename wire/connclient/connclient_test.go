package connclient_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// quotas records the Authorization header each GetQuota arrived with.
type quotas struct {
	eitriv1connect.UnimplementedQuotaServiceHandler
	got chan string
}

func (q quotas) GetQuota(_ context.Context, r *connect.Request[eitriv1.GetQuotaRequest]) (*connect.Response[eitriv1.GetQuotaResponse], error) {
	q.got <- r.Header().Get("Authorization")
	return connect.NewResponse(&eitriv1.GetQuotaResponse{}), nil
}

func server(t *testing.T) (*httptest.Server, chan string, string) {
	q := quotas{got: make(chan string, 1)}
	mux := http.NewServeMux()
	mux.Handle(eitriv1connect.NewQuotaServiceHandler(q))
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	sum := sha256.Sum256(srv.Certificate().Raw)
	return srv, q.got, hex.EncodeToString(sum[:])
}

func TestPinnedClientTalksHTTP2ToThePinnedCertificateAndSendsTheBearer(t *testing.T) {
	srv, got, fp := server(t)
	c := eitriv1connect.NewQuotaServiceClient(connclient.HTTPClient(fp), srv.URL,
		connect.WithInterceptors(connclient.Bearer("eitri_pat_x")))
	_, err := c.GetQuota(context.Background(), connect.NewRequest(&eitriv1.GetQuotaRequest{}))
	require.NoError(t, err)
	assert.Equal(t, "Bearer eitri_pat_x", <-got)

	resp, err := connclient.HTTPClient(fp).Get(srv.URL)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, 2, resp.ProtoMajor)
}

func TestPinnedClientRefusesAnyOtherCertificate(t *testing.T) {
	srv, got, _ := server(t)
	other := hex.EncodeToString(make([]byte, sha256.Size))
	c := eitriv1connect.NewQuotaServiceClient(connclient.HTTPClient(other), srv.URL,
		connect.WithInterceptors(connclient.Bearer("eitri_pat_x")))
	_, err := c.GetQuota(context.Background(), connect.NewRequest(&eitriv1.GetQuotaRequest{}))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "does not match the pinned")
	assert.Empty(t, got, "the secret never reached the imposter")
}
