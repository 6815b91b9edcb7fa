package api_test

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
)

// stoppable is a control plane run by Serve on a loopback listener (h2c
// and HTTP/1.1), with a stop a test can call: `eitri server` on SIGTERM.
func stoppable(t *testing.T) (*env, func()) {
	t.Helper()
	s, err := server.New(context.Background(), server.Config{DataDir: t.TempDir(), Plaintext: true})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(ctx, ln) }()
	stop := func() { cancel(); <-done }
	t.Cleanup(func() { stop(); s.Close() })
	h2 := &http.Transport{Protocols: new(http.Protocols)}
	h2.Protocols.SetUnencryptedHTTP2(true)
	return &env{t: t, srv: s, url: "http://" + ln.Addr().String(), http: &http.Client{Transport: h2}, admin: s.AdminToken}, stop
}

func TestWatchStreamsEndUnavailableWhenTheControlPlaneStopsSoClientsReconnect(t *testing.T) {
	for _, tc := range []struct {
		name   string
		client *http.Client
		opts   []connect.ClientOption
	}{
		{"connect over HTTP/1.1", http.DefaultClient, nil},
		{"gRPC over h2c", nil, []connect.ClientOption{connect.WithGRPC()}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, stop := stoppable(t)
			if tc.client == nil {
				tc.client = s.http
			}
			opts := append([]connect.ClientOption{bearer(s.admin)}, tc.opts...)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			vms, err := eitriv1connect.NewVMServiceClient(tc.client, s.url, opts...).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
			require.NoError(t, err)
			exps, err := eitriv1connect.NewExposureServiceClient(tc.client, s.url, opts...).WatchExposures(ctx, connect.NewRequest(&eitriv1.WatchExposuresRequest{}))
			require.NoError(t, err)
			hosts, err := eitriv1connect.NewHostServiceClient(tc.client, s.url, opts...).WatchHosts(ctx, connect.NewRequest(&eitriv1.WatchHostsRequest{}))
			require.NoError(t, err)
			streams := map[string]interface {
				Receive() bool
				Err() error
			}{"WatchVMs": vms, "WatchExposures": exps, "WatchHosts": hosts}
			for name, st := range streams {
				require.True(t, st.Receive(), "%s: the first message is the list", name)
			}

			stop()

			for name, st := range streams {
				assert.False(t, st.Receive(), name)
				err := st.Err()
				require.Error(t, err, "%s: a clean end tells a client there is nothing more, ever", name)
				assert.Equal(t, connect.CodeUnavailable, connect.CodeOf(err), "%s: %v", name, err)
				assert.Contains(t, err.Error(), "shutting down", name)
			}
		})
	}
}

func TestAnAgentStreamEndsUnavailableWhenTheControlPlaneStops(t *testing.T) {
	e, stop := stoppable(t)
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())

	stop()

	select {
	case err := <-a.ended:
		assert.Equal(t, connect.CodeUnavailable, connect.CodeOf(err), "%v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the agent's stream outlived the control plane")
	}
}
