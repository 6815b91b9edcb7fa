package mcp_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
	eitrimcp "github.com/a73x/eitri/server/mcp"
)

// bearer adds the token to every request the MCP client makes.
type bearer struct {
	token string
	next  http.RoundTripper
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return b.next.RoundTrip(r)
}

type env struct {
	url   string
	token string // the bootstrap admin's
	fleet *fleet.Fleet
}

func start(t *testing.T) env {
	t.Helper()
	return startWith(t, eitrimcp.DefaultLimits)
}

func startWith(t *testing.T, lim eitrimcp.Limits) env {
	t.Helper()
	ctx := context.Background()
	srv, err := server.New(ctx, server.Config{DataDir: t.TempDir(), Plaintext: true})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	require.NotEmpty(t, srv.AdminToken)
	hs := httptest.NewServer(eitrimcp.HandlerWithLimits(srv.Fleet, nil, lim))
	t.Cleanup(hs.Close)
	return env{url: hs.URL + "/mcp", token: srv.AdminToken, fleet: srv.Fleet}
}

// as is a context that acts as the holder of token, for setting the fleet
// up (and looking at it) the way the API would.
func (e env) as(t *testing.T, token string) context.Context {
	t.Helper()
	ctx := context.Background()
	p, err := e.fleet.Resolve(ctx, token)
	require.NoError(t, err)
	return auth.WithPrincipal(ctx, p)
}

// userToken makes a plain (non-admin) user and returns a token of theirs.
func (e env) userToken(t *testing.T, name string) string {
	t.Helper()
	_, secret, err := e.fleet.CreateToken(e.as(t, e.token), "mcp-test", 0, name)
	require.NoError(t, err)
	return secret
}

func connect(t *testing.T, e env, progress chan<- *mcp.ProgressNotificationParams) *mcp.ClientSession {
	t.Helper()
	return connectAs(t, e, e.token, progress)
}

func connectAs(t *testing.T, e env, token string, progress chan<- *mcp.ProgressNotificationParams) *mcp.ClientSession {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	opts := &mcp.ClientOptions{}
	if progress != nil {
		opts.ProgressNotificationHandler = func(_ context.Context, r *mcp.ProgressNotificationClientRequest) {
			progress <- r.Params
		}
	}
	c := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, opts)
	cs, err := c.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:             e.url,
		HTTPClient:           &http.Client{Transport: bearer{token: token, next: http.DefaultTransport}},
		DisableStandaloneSSE: true,
		MaxRetries:           -1,
	}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cs.Close() })
	return cs
}

func call(t *testing.T, cs *mcp.ClientSession, name string, args any) *mcp.CallToolResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	res, err := cs.CallTool(ctx, &mcp.CallToolParams{Name: name, Arguments: args})
	require.NoError(t, err, "a fleet error must be a tool error, not a protocol error")
	return res
}

// ok calls a tool that must succeed and decodes its structured result.
func ok[T any](t *testing.T, cs *mcp.ClientSession, name string, args any) T {
	t.Helper()
	res := call(t, cs, name, args)
	require.False(t, res.IsError, "%s: %s", name, text(res))
	return structured[T](t, res)
}

func structured[T any](t *testing.T, res *mcp.CallToolResult) T {
	t.Helper()
	raw, err := json.Marshal(res.StructuredContent)
	require.NoError(t, err)
	var out T
	require.NoError(t, json.Unmarshal(raw, &out), string(raw))
	return out
}

// refused calls a tool that must fail and returns its message.
func refused(t *testing.T, cs *mcp.ClientSession, name string, args any) string {
	t.Helper()
	res := call(t, cs, name, args)
	require.True(t, res.IsError, "%s must be refused, got %s", name, text(res))
	return text(res)
}

func text(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

func TestUnauthenticated(t *testing.T) {
	e := start(t)
	body := `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"0"}}}`
	cases := []struct {
		name, auth string
	}{
		{"no header", ""},
		{"unknown token", "Bearer eitri_pat_nope"},
		{"not bearer", "Basic " + e.token},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			req, err := http.NewRequest(http.MethodPost, e.url, strings.NewReader(body))
			require.NoError(t, err)
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Accept", "application/json, text/event-stream")
			if tc.auth != "" {
				req.Header.Set("Authorization", tc.auth)
			}
			resp, err := http.DefaultClient.Do(req)
			require.NoError(t, err)
			defer resp.Body.Close()
			assert.Equal(t, http.StatusUnauthorized, resp.StatusCode)
			assert.Equal(t, "application/json", resp.Header.Get("Content-Type"))
			raw, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			var msg struct{ Code, Message string }
			require.NoError(t, json.Unmarshal(raw, &msg), string(raw))
			assert.Equal(t, "unauthenticated", msg.Code)
			assert.NotEmpty(t, msg.Message)
		})
	}

	// The same request with the token gets through.
	req, err := http.NewRequest(http.MethodPost, e.url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json, text/event-stream")
	req.Header.Set("Authorization", "Bearer "+e.token)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	_ = resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
}
