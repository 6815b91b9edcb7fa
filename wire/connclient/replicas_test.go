package connclient_test

import (
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// deadURL is a loopback address nothing listens on.
func deadURL(t *testing.T, scheme string) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return scheme + "://" + addr
}

// frozenURL accepts connections and never answers, as a replica stopped
// with SIGSTOP does (the kernel still completes the TCP handshake).
func frozenURL(t *testing.T) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var held []net.Conn
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		<-done
		for _, c := range held {
			c.Close()
		}
	})
	return "https://" + ln.Addr().String()
}

func quota(t *testing.T, hc *http.Client, base string) error {
	c := eitriv1connect.NewQuotaServiceClient(hc, base, connect.WithInterceptors(connclient.Bearer("eitri_pat_x")))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := c.GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{}))
	return err
}

func TestReplicasClientSkipsDeadAndFrozenReplicasToReachALiveOne(t *testing.T) {
	defer connclient.SetReplicaTimeouts(time.Second, 300*time.Millisecond)()
	live, got, fp := server(t)
	hc, base, err := connclient.Replicas(fp, []string{deadURL(t, "https"), frozenURL(t), live.URL})
	require.NoError(t, err)
	require.NoError(t, quota(t, hc, base))
	assert.Equal(t, "Bearer eitri_pat_x", <-got)
}

func TestReplicasClientMovesToTheNextReplicaWhenItsOwnGoesAway(t *testing.T) {
	a, gotA, fp := server(t)
	b, gotB, _ := serverWithCert(t, a)
	hc, base, err := connclient.Replicas(fp, []string{a.URL, b.URL})
	require.NoError(t, err)
	require.NoError(t, quota(t, hc, base))
	<-gotA
	// A request on a connection that dies with its replica fails (its
	// caller retries); what matters is where the next connection goes.
	a.Close()
	hc.CloseIdleConnections()
	require.NoError(t, quota(t, hc, base))
	<-gotB
	// It stays with the replica that answered rather than trying the dead
	// one first on every new connection.
	hc.CloseIdleConnections()
	require.NoError(t, quota(t, hc, base))
	<-gotB
}

func TestReplicasClientSpeaksH2COverPlainHTTP(t *testing.T) {
	q := quotas{got: make(chan string, 1)}
	mux := http.NewServeMux()
	mux.Handle(eitriv1connect.NewQuotaServiceHandler(q))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	hc, base, err := connclient.Replicas("", []string{deadURL(t, "http"), srv.URL})
	require.NoError(t, err)
	require.NoError(t, quota(t, hc, base))
	<-q.got
}

func TestReplicasClientRefusesAPinMismatchOnEveryReplica(t *testing.T) {
	a, got, _ := server(t)
	other := strings.Repeat("0", 64)
	hc, base, err := connclient.Replicas(other, []string{a.URL})
	require.NoError(t, err)
	err = quota(t, hc, base)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "does not match the pinned")
	assert.Empty(t, got)
}

func TestReplicasRefusesListsThatCannotWork(t *testing.T) {
	for _, c := range []struct {
		name string
		urls []string
		want string
	}{
		{"none", nil, "no control plane URL"},
		{"not a URL", []string{"cp.example:7443"}, "want an http:// or https:// URL"},
		{"mixed schemes", []string{"https://a.example", "http://b.example"}, "same scheme"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := connclient.ParseReplicas(c.urls)
			require.Error(t, err)
			assert.Contains(t, err.Error(), c.want)
		})
	}
	assert.Equal(t, []string{"https://a:1", "https://b:2"}, connclient.SplitURLs(" https://a:1 ,, https://b:2,"))
}

// serverWithCert starts a second TLS server presenting like's certificate,
// as replicas sharing one serving identity do.
func serverWithCert(t *testing.T, like *httptest.Server) (*httptest.Server, chan string, string) {
	q := quotas{got: make(chan string, 1)}
	mux := http.NewServeMux()
	mux.Handle(eitriv1connect.NewQuotaServiceHandler(q))
	srv := httptest.NewUnstartedServer(mux)
	srv.EnableHTTP2 = true
	srv.TLS = like.TLS.Clone()
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv, q.got, ""
}
