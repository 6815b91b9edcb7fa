package api_test

// Attacks on the call relay (serial consoles and tunnels), replayed: one
// user taking every call slot of a host, a host credential making the
// control plane buffer gigabytes, and a calls stream that names no agent
// process. The host's side is played by hand with the generated
// AgentService client, against the real server over HTTP/2; each test fails
// if the attack works.

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/api"
	"github.com/a73x/eitri/server/callrelay"
)

// agentInstance is the played agent's process id, on Sync and Calls alike.
const agentInstance = "agent-1"

// relayAgent is a connected host whose call relay the test plays: it
// answers consoles with a boot frame (and done, without following), and
// holds every input untyped until release, as for a guest that does not
// read its console.
type relayAgent struct {
	id, cred string
	ac       eitriv1connect.AgentServiceClient
	ctx      context.Context
	gate     chan struct{}
	release  func()
	// holding counts input calls answered and not typed yet.
	holding atomic.Int64
	// divert, when set, takes every call instead of answering it.
	divert atomic.Pointer[chan *eitriv1.CallsResponse]
}

func (e *env) relayAgent(name string) *relayAgent {
	e.t.Helper()
	id, cred := e.enroll(name)
	e.connectWith(id, cred, big(), &eitriv1.Hello{AgentVersion: "test", Address: "192.0.2.10", Accelerator: "tcg", InstanceId: agentInstance})
	ctx, cancel := context.WithCancel(context.Background())
	r := &relayAgent{id: id, cred: cred, ac: eitriv1connect.NewAgentServiceClient(e.http, e.url, bearer(cred)), ctx: ctx, gate: make(chan struct{})}
	var once sync.Once
	r.release = func() { once.Do(func() { close(r.gate) }) }
	e.t.Cleanup(func() { r.release(); cancel() })
	go func() {
		// The stream's headers come with its first call: it is opened here
		// and ready once a call gets through (see ready).
		calls, err := r.ac.Calls(ctx, connect.NewRequest(&eitriv1.CallsRequest{InstanceId: agentInstance}))
		if err != nil {
			return
		}
		for calls.Receive() {
			c := calls.Msg()
			if d := r.divert.Load(); d != nil {
				*d <- c
				continue
			}
			go r.serve(c)
		}
	}()
	return r
}

func (r *relayAgent) serve(c *eitriv1.CallsResponse) {
	st := r.ac.Console(r.ctx)
	defer func() { _ = st.CloseRequest(); _ = st.CloseResponse() }()
	if st.Send(&eitriv1.ConsoleRequest{CallId: c.GetId()}) != nil {
		return
	}
	// The control plane sends nothing; its end of the stream is the
	// caller leaving.
	left := make(chan struct{})
	go func() {
		defer close(left)
		for {
			if _, err := st.Receive(); err != nil {
				return
			}
		}
	}()
	switch {
	case c.GetConsoleOutput() != nil:
		_ = st.Send(&eitriv1.ConsoleRequest{Boot: "b1", Data: []byte("login: ")})
		if c.GetConsoleOutput().GetNoFollow() {
			_ = st.Send(&eitriv1.ConsoleRequest{Done: true})
		}
	case c.GetConsoleInput() != nil:
		r.holding.Add(1)
		select {
		case <-r.gate:
		case <-left:
		}
		r.holding.Add(-1)
		_ = st.Send(&eitriv1.ConsoleRequest{Done: true})
	}
	<-left
}

// readConsole reads vmID's console without following: the host's output so
// far, or the error that refused it.
func readConsole(ctx context.Context, vms eitriv1connect.VMServiceClient, vmID string) error {
	st, err := vms.StreamConsole(ctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: vmID, NoFollow: true}))
	if err != nil {
		return err
	}
	for st.Receive() {
	}
	return st.Err()
}

// ready waits until the host's Calls stream relays vmID's console.
func (r *relayAgent) ready(t *testing.T, vms eitriv1connect.VMServiceClient, vmID string) {
	t.Helper()
	require.Eventually(t, func() bool { return readConsole(context.Background(), vms, vmID) == nil },
		10*time.Second, 10*time.Millisecond, "the host relays the vm's console")
}

// nextCall follows vmID's console until the test ends, and hands the test
// the call it becomes instead of answering it, with what the follower
// receives.
func (r *relayAgent) nextCall(t *testing.T, vms eitriv1connect.VMServiceClient, vmID string) (*eitriv1.CallsResponse, <-chan string) {
	t.Helper()
	ch := make(chan *eitriv1.CallsResponse, 1)
	r.divert.Store(&ch)
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	out := make(chan string, 16)
	go func() {
		if st, err := vms.StreamConsole(ctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: vmID})); err == nil {
			for st.Receive() {
				out <- string(st.Msg().GetData())
			}
		}
	}()
	select {
	case c := <-ch:
		return c, out
	case <-time.After(10 * time.Second):
		t.Fatal("the console call never reached the host")
		return nil, nil
	}
}

// A host's call slots are shared by every user with a VM on it, so one user
// must not be able to hold them all: here one types one byte at a time into
// a guest that reads nothing, far more calls at once than a host has slots,
// while another user opens their console 50 times. An input held a slot
// until the guest read it, up to 15 s, so the other user would be refused
// ("host serves 256 consoles already").
func TestOneUsersInputFloodLeavesAnotherUserTheirConsole(t *testing.T) {
	e := newEnv(t)
	r := e.relayAgent("h1")
	mallory, alice := e.tenant("mallory"), e.tenant("alice")
	mvm := e.mustCreateVM(mallory, createReq("m-1")).Id
	avm := e.mustCreateVM(alice, createReq("a-1")).Id
	r.ready(t, e.vms(mallory), mvm)

	// In waves, as a steady stream would arrive (a burst larger than a
	// host's call queue is turned away at the queue).
	const flood, wave = 300, 50
	ctx := context.Background()
	var returned atomic.Int64
	errs := make(chan error, flood)
	for sent := wave; sent <= flood; sent += wave {
		for range wave {
			go func() {
				_, err := e.vms(mallory).SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: mvm, Data: []byte("x")}))
				errs <- err
				returned.Add(1)
			}()
		}
		require.Eventually(t, func() bool { return r.holding.Load()+returned.Load() == int64(sent) }, 20*time.Second, 5*time.Millisecond,
			"every input of the wave is either held by the host or answered")
	}
	assert.EqualValues(t, 1, r.holding.Load(), "one input per vm is in flight")

	for i := range 50 {
		require.NoError(t, readConsole(ctx, e.vms(alice), avm), "alice's console, attempt %d", i+1)
	}

	refused := 0
	for range flood - 1 {
		err := <-errs
		if assert.Equal(t, connect.CodeResourceExhausted, code(err), "%v", err) {
			assert.Contains(t, err.Error(), "one call at a time per vm")
			refused++
		}
	}
	assert.Equal(t, flood-1, refused)
	r.release()
	assert.NoError(t, <-errs, "the input in flight is typed once the guest reads")
	_, err := e.vms(mallory).SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: mvm, Data: []byte("y")}))
	assert.NoError(t, err, "the next input goes through")
}

// The per-user share: a user allowed any number of streams still holds at
// most a quarter of a host's call slots, so another user always gets a
// console.
func TestOneUserHoldsAtMostTheirShareOfAHostsCallSlots(t *testing.T) {
	e := newEnv(t)
	r := e.relayAgent("h1")
	mallory, alice := e.tenant("mallory"), e.tenant("alice")
	many := int64(1000)
	e.setQuota("mallory", &eitriv1.QuotaLimits{Streams: &many})
	mvm := e.mustCreateVM(mallory, createReq("m-1")).Id
	avm := e.mustCreateVM(alice, createReq("a-1")).Id
	r.ready(t, e.vms(mallory), mvm)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	open := 0
	var refused error
	for open <= 256 {
		st, err := e.vms(mallory).StreamConsole(ctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: mvm}))
		require.NoError(t, err)
		if !st.Receive() {
			refused = st.Err()
			break
		}
		open++
	}
	assert.Equal(t, callrelay.MaxHostCallsPerUser, open)
	assert.Equal(t, connect.CodeResourceExhausted, code(refused), "%v", refused)
	if refused != nil {
		assert.Contains(t, refused.Error(), fmt.Sprintf("mallory has %d consoles, console inputs and tunnels open on this vm's host already, the most one user may on one host", callrelay.MaxHostCallsPerUser))
	}
	assert.NoError(t, readConsole(ctx, e.vms(alice), avm), "another user still gets a console on that host")
}

// hostRequest is the header of a hand-made gRPC call with a host
// credential.
func hostRequest(cred string) http.Header {
	return http.Header{"Content-Type": {"application/grpc"}, "Te": {"trailers"}, "Authorization": {"Bearer " + cred}}
}

// consoleFrame is one uncompressed Console stream message.
func consoleFrame(t *testing.T, m *eitriv1.ConsoleRequest) []byte {
	t.Helper()
	b, err := proto.Marshal(m)
	require.NoError(t, err)
	return envelope(0, b)
}

// A host's credential may be stolen, or its agent compromised: 120 Console
// streams, each one 7 MiB frame, from a host with no call to answer. Each
// frame read whole (8 MiB allowed) before anything looked at its call would
// cost 1.8 GiB, so a stream no call waits for is refused unread.
func TestAnAnswerStreamFromAHostWithNoCallWaitingIsRefusedUnread(t *testing.T) {
	e, probe := probedEnv(t, server.Config{})
	_, cred := e.enroll("h1")
	frame := consoleFrame(t, &eitriv1.ConsoleRequest{CallId: "call-made-up", Data: bytes.Repeat([]byte("x"), 7<<20)})
	before := allocated()
	for i := range 120 {
		probe.read.Store(0)
		got := send(t, e.http, e.url, eitriv1connect.AgentServiceConsoleProcedure, hostRequest(cred), frame, i%2 == 1)
		require.Equal(t, "not_found", got.code, "%+v", got)
		assert.Contains(t, got.message, "no call of this host's is waiting for an answer")
		require.Zero(t, probe.read.Load(), "stream %d: not one byte of it is read", i+1)
	}
	grew := allocated() - before
	t.Logf("120 streams of 7 MiB: %.1f MiB allocated, client included", float64(grew)/(1<<20))
	assert.Less(t, grew, uint64(120<<20), "well under a MiB a stream; each frame read would be 7 MiB or more")
}

// unansweredConsoleCall is a probed control plane with a played host
// running web-1, and a console call to web-1 the host was sent and leaves
// for the test to answer (out: what the console's follower receives).
func unansweredConsoleCall(t *testing.T) (*env, *bodyProbe, *relayAgent, *eitriv1.CallsResponse, <-chan string) {
	t.Helper()
	e, probe := probedEnv(t, server.Config{})
	r := e.relayAgent("h1")
	vm := e.mustCreateVM(e.admin, createReq("web-1")).Id
	r.ready(t, e.vms(e.admin), vm)
	c, out := r.nextCall(t, e.vms(e.admin), vm)
	return e, probe, r, c, out
}

// A host answering a real call is held to a chunk per message, as tunnels
// are, so an answer costs the control plane no more than a chunk: its 7 MiB
// frame is refused without being buffered.
func TestAConsoleAnswerIsBoundedToAChunk(t *testing.T) {
	e, _, r, c, _ := unansweredConsoleCall(t)

	frame := consoleFrame(t, &eitriv1.ConsoleRequest{CallId: c.GetId(), Data: bytes.Repeat([]byte("x"), 7<<20)})
	hc := &http.Client{Transport: e.http.Transport, Timeout: 10 * time.Second}
	before := allocated()
	got := send(t, hc, e.url, eitriv1connect.AgentServiceConsoleProcedure, hostRequest(r.cred), frame, false)
	grew := allocated() - before
	assert.Equal(t, "resource_exhausted", got.code, "%+v", got)
	assert.Contains(t, got.message, fmt.Sprintf("larger than configured max %d", api.MaxConsoleMessage))
	t.Logf("one 7 MiB answer: %.1f MiB allocated, client included", float64(grew)/(1<<20))
	assert.Less(t, grew, uint64(7<<20), "less than the frame: it is never buffered whole")
}

// Every answer stream costs the control plane a buffer, so a host may open
// no more of them than it has calls waiting; one past that is refused before
// a byte of it is read, and the stream that does answer the call still
// carries it.
func TestAHostOpensNoMoreAnswerStreamsThanCallsWaiting(t *testing.T) {
	e, probe, r, c, out := unansweredConsoleCall(t)

	// One stream opens and names nothing yet: it may be the call's answer.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	answer := r.ac.Console(ctx)
	require.NoError(t, answer.Send(nil))
	small := consoleFrame(t, &eitriv1.ConsoleRequest{CallId: "call-made-up"})
	var got outcome
	require.Eventually(t, func() bool {
		got = send(t, e.http, e.url, eitriv1connect.AgentServiceConsoleProcedure, hostRequest(r.cred), small, false)
		return got.code == "resource_exhausted"
	}, 10*time.Second, 5*time.Millisecond, "a second stream for the one call waiting is refused once the first is open")
	assert.Contains(t, got.message, "answer streams: this host has 1 calls waiting for an answer and 1 streams opening")

	probe.read.Store(0)
	frame := consoleFrame(t, &eitriv1.ConsoleRequest{CallId: c.GetId(), Data: bytes.Repeat([]byte("x"), 7<<20)})
	got = send(t, e.http, e.url, eitriv1connect.AgentServiceConsoleProcedure, hostRequest(r.cred), frame, true)
	assert.Equal(t, "resource_exhausted", got.code, "%+v", got)
	assert.Zero(t, probe.read.Load(), "not one byte of it is read")

	// The open stream answers the call.
	require.NoError(t, answer.Send(&eitriv1.ConsoleRequest{CallId: c.GetId()}))
	require.NoError(t, answer.Send(&eitriv1.ConsoleRequest{Boot: "b1", Data: []byte("login: ")}))
	select {
	case got := <-out:
		assert.Equal(t, "login: ", got)
	case <-time.After(10 * time.Second):
		t.Fatal("the answer never reached the console's follower")
	}
}

// The lower finding: a second agent with the host's credential that named
// no process on its Calls stream skipped the duplicate-agent check and took
// the host's calls. It is refused, naming the field, and the agent holding
// the host's streams keeps its calls.
func TestACallsStreamThatNamesNoAgentProcessIsRefused(t *testing.T) {
	e := newEnv(t)
	r := e.relayAgent("h1")
	vm := e.mustCreateVM(e.admin, createReq("web-1")).Id
	r.ready(t, e.vms(e.admin), vm)

	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	calls, err := r.ac.Calls(ctx, connect.NewRequest(&eitriv1.CallsRequest{}))
	require.NoError(t, err)
	assert.False(t, calls.Receive())
	assert.Equal(t, connect.CodeInvalidArgument, code(calls.Err()), "%v", calls.Err())
	assert.ErrorContains(t, calls.Err(), "instance_id: required")

	clone, err := r.ac.Calls(ctx, connect.NewRequest(&eitriv1.CallsRequest{InstanceId: "agent-clone"}))
	require.NoError(t, err)
	assert.False(t, clone.Receive())
	assert.Equal(t, connect.CodeFailedPrecondition, code(clone.Err()), "%v", clone.Err())

	assert.NoError(t, readConsole(context.Background(), e.vms(e.admin), vm), "the host's own agent still answers its calls")
}
