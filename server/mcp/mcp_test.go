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

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
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
	token string
	fleet *fleet.Fleet
}

func start(t *testing.T) env {
	t.Helper()
	ctx := context.Background()
	srv, err := server.New(ctx, server.Config{DataDir: t.TempDir(), Plaintext: true})
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	require.NotEmpty(t, srv.AdminToken)
	hs := httptest.NewServer(eitrimcp.Handler(srv.Fleet, nil))
	t.Cleanup(hs.Close)
	return env{url: hs.URL + "/mcp", token: srv.AdminToken, fleet: srv.Fleet}
}

func connect(t *testing.T, e env, progress chan<- *mcp.ProgressNotificationParams) *mcp.ClientSession {
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
		HTTPClient:           &http.Client{Transport: bearer{token: e.token, next: http.DefaultTransport}},
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

func text(res *mcp.CallToolResult) string {
	var b strings.Builder
	for _, c := range res.Content {
		if tc, ok := c.(*mcp.TextContent); ok {
			b.WriteString(tc.Text)
		}
	}
	return b.String()
}

func TestListTools(t *testing.T) {
	cs := connect(t, start(t), nil)
	res, err := cs.ListTools(context.Background(), nil)
	require.NoError(t, err)
	var names []string
	for _, tl := range res.Tools {
		names = append(names, tl.Name)
		assert.NotEmpty(t, tl.Description, tl.Name)
	}
	assert.ElementsMatch(t, []string{"vm_list", "vm_get", "vm_create", "vm_start", "vm_stop", "vm_delete", "vm_retry"}, names)
}

func TestVMListEmpty(t *testing.T) {
	cs := connect(t, start(t), nil)
	res := call(t, cs, "vm_list", map[string]any{})
	require.False(t, res.IsError, text(res))
	raw, err := json.Marshal(res.StructuredContent)
	require.NoError(t, err)
	assert.JSONEq(t, `{"vms":[]}`, string(raw))
}

func validCreate() map[string]any {
	return map[string]any{
		"name": "web-1", "image_url": "http://127.0.0.1/img.raw",
		"image_sha256": strings.Repeat("a", 64), "vcpus": 1, "mem_mb": 512, "disk_gb": 4,
		"wait_seconds": 2,
	}
}

func TestToolErrors(t *testing.T) {
	cs := connect(t, start(t), nil)
	with := func(k string, v any) map[string]any {
		m := validCreate()
		m[k] = v
		return m
	}
	cases := []struct {
		name, tool string
		args       any
		want       string
	}{
		{"bad name", "vm_create", with("name", "Not_A_Label"), "name: "},
		{"bad sha", "vm_create", with("image_sha256", "abc"), "image_sha256: "},
		{"negative wait", "vm_create", with("wait_seconds", -1), "wait_seconds: "},
		// No host is connected, so placement refuses before anything is stored.
		{"no host", "vm_create", validCreate(), "no connected host has room for 1 vCPU, 512 MiB memory and 4 GiB disk"},
		{"unknown vm", "vm_get", map[string]any{"id": "vm_nope"}, "vm vm_nope not found"},
		{"start unknown", "vm_start", map[string]any{"id": "vm_nope"}, "not found"},
		{"stop unknown", "vm_stop", map[string]any{"id": "vm_nope"}, "not found"},
		{"delete unknown", "vm_delete", map[string]any{"id": "vm_nope"}, "not found"},
		{"retry unknown", "vm_retry", map[string]any{"id": "vm_nope"}, "not found"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			res := call(t, cs, tc.tool, tc.args)
			assert.True(t, res.IsError)
			assert.Contains(t, text(res), tc.want)
		})
	}
	// Nothing was created along the way.
	res := call(t, cs, "vm_list", map[string]any{})
	raw, _ := json.Marshal(res.StructuredContent)
	assert.JSONEq(t, `{"vms":[]}`, string(raw))
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

// host enrolls a host and connects it in process, through the same fleet
// calls the agent stream handler makes, with room for small VMs.
type host struct {
	t    *testing.T
	sess *fleet.Session
	vms  []*eitriv1.ActualVM
}

func connectHost(t *testing.T, e env) *host {
	t.Helper()
	ctx := context.Background()
	p, err := e.fleet.Resolve(ctx, e.token)
	require.NoError(t, err)
	jt, err := e.fleet.CreateJoinToken(auth.WithPrincipal(ctx, p), time.Hour)
	require.NoError(t, err)
	er, err := e.fleet.Enroll(ctx, &eitriv1.EnrollRequest{JoinToken: jt.GetToken(), Hostname: "h1", AgentVersion: "test"})
	require.NoError(t, err)
	s, err := e.fleet.OpenSession(ctx, er.GetHostId(), &eitriv1.Hello{HostId: er.GetHostId(), AgentVersion: "test", Hostname: "h1"}, "192.0.2.1:1")
	require.NoError(t, err)
	t.Cleanup(s.Close)
	h := &host{t: t, sess: s}
	h.report()
	return h
}

func (h *host) report(vms ...*eitriv1.ActualVM) {
	h.sess.Apply(context.Background(), &eitriv1.ActualStateReport{
		Vms:      vms,
		Capacity: &eitriv1.Capacity{Vcpus: 8, MemMb: 16384, DiskGb: 200},
	})
}

// createInBackground calls vm_create asking for progress, and returns the
// progress messages as they come and the result when it does.
func createInBackground(t *testing.T, cs *mcp.ClientSession, progress <-chan *mcp.ProgressNotificationParams, wait int) (<-chan string, <-chan *mcp.CallToolResult) {
	t.Helper()
	args := validCreate()
	args["wait_seconds"] = wait
	params := &mcp.CallToolParams{Name: "vm_create", Arguments: args}
	params.SetProgressToken("create-1")
	msgs := make(chan string, 16)
	done := make(chan *mcp.CallToolResult, 1)
	go func() {
		for p := range progress {
			if p.ProgressToken == "create-1" {
				msgs <- p.Message
			}
		}
	}()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 8*time.Second)
		defer cancel()
		res, err := cs.CallTool(ctx, params)
		if err != nil {
			res = &mcp.CallToolResult{IsError: true, Content: []mcp.Content{&mcp.TextContent{Text: "protocol error: " + err.Error()}}}
		}
		done <- res
	}()
	return msgs, done
}

func next(t *testing.T, msgs <-chan string) string {
	t.Helper()
	select {
	case m := <-msgs:
		return m
	case <-time.After(5 * time.Second):
		t.Fatal("no progress notification")
		return ""
	}
}

func onlyVMID(t *testing.T, e env) string {
	t.Helper()
	ctx := context.Background()
	p, err := e.fleet.Resolve(ctx, e.token)
	require.NoError(t, err)
	vms, err := e.fleet.ListVMs(auth.WithPrincipal(ctx, p))
	require.NoError(t, err)
	require.Len(t, vms, 1)
	return vms[0].GetId()
}

func TestVMCreateNarratesUntilReady(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connect(t, e, progress)
	msgs, done := createInBackground(t, cs, progress, 60)

	assert.Equal(t, "creating vm web-1: pending", next(t, msgs))
	id := onlyVMID(t, e)

	h.report(&eitriv1.ActualVM{VmId: id, Phase: "creating", Power: "stopped", StatusDetail: "downloading image 1.2/3.7 GiB"})
	assert.Equal(t, "creating vm web-1: creating, downloading image 1.2/3.7 GiB", next(t, msgs))
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "creating", Power: "stopped", StatusDetail: "booting"})
	assert.Equal(t, "creating vm web-1: creating, booting", next(t, msgs))
	// Ready without an address is not done yet: nobody can reach it.
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "ready", Power: "running"})
	assert.Equal(t, "creating vm web-1: ready", next(t, msgs))
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "ready", Power: "running", Ip: "10.77.0.5"})

	res := <-done
	require.False(t, res.IsError, text(res))
	raw, err := json.Marshal(res.StructuredContent)
	require.NoError(t, err)
	var out struct {
		VM struct {
			ID         string `json:"id"`
			Lifecycle  string `json:"lifecycle"`
			AssignedIP string `json:"assigned_ip"`
		} `json:"vm"`
		Note string `json:"note"`
	}
	require.NoError(t, json.Unmarshal(raw, &out))
	assert.Equal(t, "10.77.0.5", out.VM.AssignedIP)
	assert.Empty(t, out.Note)
	assert.Equal(t, "ready", out.VM.Lifecycle)
	assert.Equal(t, id, out.VM.ID)
}

func TestVMCreateReportsFailure(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connect(t, e, progress)
	msgs, done := createInBackground(t, cs, progress, 60)

	next(t, msgs)
	id := onlyVMID(t, e)
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "failed", Power: "stopped", LastError: "image sha256 mismatch"})

	res := <-done
	assert.True(t, res.IsError)
	assert.Contains(t, text(res), "failed: image sha256 mismatch")
}

func TestVMCreateTimeoutIsNotFailure(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connect(t, e, progress)
	msgs, done := createInBackground(t, cs, progress, 1)

	next(t, msgs)
	id := onlyVMID(t, e)
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "creating", Power: "stopped", StatusDetail: "preparing root disk"})

	res := <-done
	require.False(t, res.IsError, text(res))
	raw, err := json.Marshal(res.StructuredContent)
	require.NoError(t, err)
	assert.Contains(t, string(raw), "still being created")
	assert.Contains(t, string(raw), "not a failure")
	assert.Contains(t, string(raw), `"id":"`+id+`"`)
}

func TestVMRetryTriesAFailedVMAgain(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connect(t, e, progress)
	msgs, done := createInBackground(t, cs, progress, 60)
	next(t, msgs)
	id := onlyVMID(t, e)
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "failed", Power: "stopped", LastError: "no space left on device"})
	require.True(t, (<-done).IsError)

	res := call(t, cs, "vm_retry", map[string]any{"id": id})
	require.False(t, res.IsError, text(res))
	raw, err := json.Marshal(res.StructuredContent)
	require.NoError(t, err)
	assert.Contains(t, string(raw), `"lifecycle":"retrying"`)

	h.report(&eitriv1.ActualVM{VmId: id, Phase: "creating", Power: "stopped", StatusDetail: "downloading image", Retry: 1})
	res = call(t, cs, "vm_retry", map[string]any{"id": id})
	assert.True(t, res.IsError)
	assert.Contains(t, text(res), "only a failed VM can be retried")
}
