package mcp_test

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	eitrimcp "github.com/a73x/eitri/server/mcp"
)

const initializeBody = `{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"x","version":"0"}}}`

// send makes one raw MCP request as token, on session (when not empty),
// and returns the response with its body read (unless stream, for a GET
// that stays open).
func send(t *testing.T, e env, method, token, session, body string) *http.Response {
	t.Helper()
	req, err := http.NewRequest(method, e.url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+token)
	req.Header.Set("Accept", "application/json, text/event-stream")
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	if session != "" {
		req.Header.Set("Mcp-Session-Id", session)
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	if method == http.MethodGet && resp.StatusCode == http.StatusOK {
		t.Cleanup(func() { _ = resp.Body.Close() })
		return resp // the event stream: open until the session ends
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body = io.NopCloser(strings.NewReader(string(raw)))
	return resp
}

// initialize opens a session the way a client does, and returns its id.
func initialize(t *testing.T, e env, token string) string {
	t.Helper()
	resp := send(t, e, http.MethodPost, token, "", initializeBody)
	require.Equal(t, http.StatusOK, resp.StatusCode, body(t, resp))
	id := resp.Header.Get("Mcp-Session-Id")
	require.NotEmpty(t, id)
	return id
}

func pingStatus(t *testing.T, e env, token, session string) int {
	t.Helper()
	return send(t, e, http.MethodPost, token, session, `{"jsonrpc":"2.0","id":2,"method":"ping"}`).StatusCode
}

func body(t *testing.T, resp *http.Response) string {
	t.Helper()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(raw)
}

// refusal is a 429 with the limit named in a JSON body.
func refusal(t *testing.T, resp *http.Response) string {
	t.Helper()
	// Checked before the body is read: an admitted event stream never ends.
	require.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
	raw := body(t, resp)
	var msg struct{ Code, Message string }
	require.NoError(t, json.Unmarshal([]byte(raw), &msg), raw)
	assert.Equal(t, "resource_exhausted", msg.Code)
	return msg.Message
}

// setStreams sets user's streams quota, as the admin.
func (e env) setStreams(t *testing.T, user string, n int64) {
	t.Helper()
	_, err := e.fleet.SetQuota(e.as(t, e.token), &eitriv1.SetQuotaRequest{
		UserName: user, Limits: &eitriv1.QuotaLimits{Streams: proto.Int64(n)},
	})
	require.NoError(t, err)
}

// streamsUsed is how many streams the quota counts token's user holding.
func (e env) streamsUsed(t *testing.T, token string) int64 {
	t.Helper()
	q, err := e.fleet.GetQuota(e.as(t, token), "")
	require.NoError(t, err)
	return q.GetUsage().GetStreams()
}

func heapLive() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// Every initialize opens a session that lives until it is idle, so a flood
// of them from one token would keep thousands: the user's oldest idle
// sessions make way instead. Every initialize works, only the newest few
// stay open, and the heap does not grow with the flood.
func TestAnInitializeFloodKeepsOnlyTheUsersNewestSessions(t *testing.T) {
	const perUser, flood = 4, 400
	e := startWith(t, eitrimcp.Limits{SessionsPerUser: perUser, SessionRate: rate.Inf, SessionBurst: 1})
	bob := e.userToken(t, "bob")
	alice := e.userToken(t, "alice")
	alices := initialize(t, e, alice)
	before := heapLive()

	ids := make([]string, flood)
	for i := range ids {
		ids[i] = initialize(t, e, bob)
	}

	var open []string
	for _, id := range ids {
		switch st := pingStatus(t, e, bob, id); st {
		case http.StatusOK:
			open = append(open, id)
		case http.StatusNotFound:
		default:
			t.Fatalf("ping on session %s: %d", id, st)
		}
	}
	assert.Equal(t, ids[flood-perUser:], open, "only the newest sessions stay open")
	assert.Equal(t, http.StatusOK, pingStatus(t, e, alice, alices), "another user's session is not theirs to evict")

	// Evicted sessions close in the background; 400 kept would be ~6 MiB.
	require.Eventually(t, func() bool { return heapLive() < before+2<<20 }, 10*time.Second, 20*time.Millisecond,
		"the heap grows with the flood")
}

// Eviction takes only idle sessions: one whose call is still running is
// not cut off, so with every session busy a new one is refused, naming the
// limit, and the running call finishes.
func TestANewSessionIsRefusedWhenEverySessionHasACallInProgress(t *testing.T) {
	e := startWith(t, eitrimcp.Limits{SessionsPerUser: 1})
	h := connectHost(t, e)
	bob := e.userToken(t, "bob")
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connectAs(t, e, bob, progress)
	notices, done := createWaiting(t, cs, progress, 60)
	next(t, notices) // the call is running

	msg := refusal(t, send(t, e, http.MethodPost, bob, "", initializeBody))
	assert.Contains(t, msg, "mcp sessions: bob has 1 of 1 MCP sessions open, each with a call in progress")

	id := onlyVMID(t, e)
	h.report(&eitriv1.ActualVM{VmId: id, Phase: "ready", Power: "running", Ip: "10.77.0.5"})
	res := result(t, done)
	require.False(t, res.IsError, text(res))
}

func TestNewSessionsPastTheUsersRateAreRefusedNamingTheLimit(t *testing.T) {
	const burst = 3
	e := startWith(t, eitrimcp.Limits{SessionsPerUser: 100, SessionRate: rate.Every(time.Hour), SessionBurst: burst})
	bob := e.userToken(t, "bob")
	var ids []string
	for range burst {
		ids = append(ids, initialize(t, e, bob))
	}

	resp := send(t, e, http.MethodPost, bob, "", initializeBody)
	msg := refusal(t, resp)
	assert.Contains(t, msg, "mcp session rate: bob may open 3 MCP sessions at once and then one every 1h0m0s")
	after, err := strconv.Atoi(resp.Header.Get("Retry-After"))
	require.NoError(t, err)
	assert.Greater(t, after, 0)

	// The rate is on new sessions only, and per user.
	assert.Equal(t, http.StatusOK, pingStatus(t, e, bob, ids[0]))
	initialize(t, e, e.userToken(t, "alice"))
}

func TestAnIdleSessionIsClosed(t *testing.T) {
	e := startWith(t, eitrimcp.Limits{SessionIdle: 50 * time.Millisecond})
	id := initialize(t, e, e.token)
	// Only requests (POSTs) keep a session alive: its event stream ends
	// when the idle timer closes it.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.url, nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+e.token)
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("Mcp-Session-Id", id)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	_, err = io.Copy(io.Discard, resp.Body)
	require.NoError(t, err, "the stream must end with the session, not the test's deadline")
	require.Eventually(t, func() bool {
		return pingStatus(t, e, e.token, id) == http.StatusNotFound
	}, 10*time.Second, 20*time.Millisecond)
}

func TestASessionIsOnlyItsOwnersToUse(t *testing.T) {
	e := start(t)
	bob := e.userToken(t, "bob")
	id := initialize(t, e, bob)
	assert.Equal(t, http.StatusNotFound, pingStatus(t, e, e.userToken(t, "alice"), id))
	assert.Equal(t, http.StatusOK, pingStatus(t, e, bob, id))
}

// An MCP event stream (GET /mcp) holds the control plane's resources as a
// Watch stream does, so the streams quota must see it: it counts as Watch
// streams do, is refused past the quota with the same message, and gives
// its slot back when it ends.
func TestMCPEventStreamsCountInTheStreamsQuota(t *testing.T) {
	e := start(t)
	bob := e.userToken(t, "bob")
	e.setStreams(t, "bob", 3)

	sessions := make([]string, 4)
	streams := make([]*http.Response, 3)
	for i := range sessions {
		sessions[i] = initialize(t, e, bob)
	}
	for i := range streams {
		streams[i] = send(t, e, http.MethodGet, bob, sessions[i], "")
		require.Equal(t, http.StatusOK, streams[i].StatusCode)
	}
	assert.Equal(t, int64(3), e.streamsUsed(t, bob))

	msg := refusal(t, send(t, e, http.MethodGet, bob, sessions[3], ""))
	assert.Contains(t, msg, "quota: streams: bob already has 3 of 3 streams open")
	assert.Contains(t, msg, "MCP event streams")

	// Ending the session ends its stream; the server releases the slot
	// before it finishes the response.
	resp := send(t, e, http.MethodDelete, bob, sessions[0], "")
	require.Equal(t, http.StatusNoContent, resp.StatusCode)
	_, _ = io.Copy(io.Discard, streams[0].Body)
	assert.Equal(t, int64(2), e.streamsUsed(t, bob))
	assert.Equal(t, http.StatusOK, send(t, e, http.MethodGet, bob, sessions[3], "").StatusCode)
	assert.Equal(t, int64(3), e.streamsUsed(t, bob))
}

// vm_create's wait for ready is a stream too, held while the call runs.
func TestAVMCreateWaitCountsInTheStreamsQuotaWhileItRuns(t *testing.T) {
	e := start(t)
	h := connectHost(t, e)
	bob := e.userToken(t, "bob")
	progress := make(chan *mcp.ProgressNotificationParams, 16)
	cs := connectAs(t, e, bob, progress)

	notices, done := createWaiting(t, cs, progress, 60)
	next(t, notices) // the wait has its stream
	assert.Equal(t, int64(1), e.streamsUsed(t, bob))

	h.report(&eitriv1.ActualVM{VmId: onlyVMID(t, e), Phase: "ready", Power: "running", Ip: "10.77.0.5"})
	res := result(t, done)
	require.False(t, res.IsError, text(res))
	assert.Equal(t, int64(0), e.streamsUsed(t, bob))
}

// A client whose session was evicted is told it is gone (404), which the
// SDK's client reports as a missing session, and a new one works.
func TestAnEvictedSessionsClientIsToldItIsGone(t *testing.T) {
	e := startWith(t, eitrimcp.Limits{SessionsPerUser: 1})
	bob := e.userToken(t, "bob")
	old := connectAs(t, e, bob, nil)
	connectAs(t, e, bob, nil)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := old.Ping(ctx, nil)
	require.ErrorIs(t, err, mcp.ErrSessionMissing)
}

// A client past its streams quota still works: the SDK's client takes the
// refused event stream as one the server does not offer, and its calls
// answer over their own responses.
func TestAClientWithNoStreamsLeftStillCallsTools(t *testing.T) {
	e := start(t)
	bob := e.userToken(t, "bob")
	e.setStreams(t, "bob", 0)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	gets := make(chan int, 4)
	c := mcp.NewClient(&mcp.Implementation{Name: "test", Version: "v0"}, nil)
	cs, err := c.Connect(ctx, &mcp.StreamableClientTransport{
		Endpoint:   e.url,
		HTTPClient: &http.Client{Transport: getStatuses{gets, bearer{token: bob, next: http.DefaultTransport}}},
		MaxRetries: -1,
	}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cs.Close() })

	select {
	case st := <-gets:
		require.Equal(t, http.StatusTooManyRequests, st, "the event stream is refused")
	case <-ctx.Done():
		t.Fatal("the client never asked for its event stream")
	}
	out := ok[eitrimcp.VMListOut](t, cs, "vm_list", map[string]any{})
	assert.Empty(t, out.VMs)
}

// getStatuses reports the status of each GET (the event stream).
type getStatuses struct {
	statuses chan<- int
	next     http.RoundTripper
}

func (g getStatuses) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := g.next.RoundTrip(r)
	if err == nil && r.Method == http.MethodGet {
		g.statuses <- resp.StatusCode
	}
	return resp, err
}
