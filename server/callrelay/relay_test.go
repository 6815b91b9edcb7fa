package callrelay

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
)

// hosts is a fleet of one replica's word on its hosts.
type hosts struct {
	instance  map[string]string // host id → the agent process holding it here
	elsewhere map[string]bool
}

func (h hosts) Instance(id string) (string, bool) {
	i, ok := h.instance[id]
	return i, ok
}

func (h hosts) HeldElsewhere(id string) bool { return h.elsewhere[id] }

// postbox is the database's side of calls between replicas.
type postbox struct {
	mu      sync.Mutex
	posted  []store.PostedCall
	dropped []string
}

func (p *postbox) PostCall(_ context.Context, c store.PostedCall) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.posted = append(p.posted, c)
	return nil
}

func (p *postbox) DropCall(_ context.Context, id string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.dropped = append(p.dropped, id)
	return nil
}

func (p *postbox) TakeCalls(_ context.Context, ids []string) ([]store.PostedCall, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out, keep []store.PostedCall
	for _, c := range p.posted {
		if slices.Contains(ids, c.HostID) {
			out = append(out, c)
		} else {
			keep = append(keep, c)
		}
	}
	p.posted = keep
	return out, nil
}

var alice = auth.Principal{UserID: "u1", Name: "alice"}

func to(host string) Authorize {
	return func(context.Context, string) (Target, error) { return Target{HostID: host, Caller: alice}, nil }
}

func kind(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	return 0
}

// answer plays the agent: it takes the next call off line, answers it on
// a Console stream with data and then done. It runs on its own goroutine,
// so it asserts rather than stops the test.
func answer(t *testing.T, r *Relay, line *CallLine, host string, data string) {
	ctx := context.Background()
	c, err := line.Next(ctx)
	if !assert.NoError(t, err) {
		return
	}
	done, err := r.OpenAnswer(host)
	if !assert.NoError(t, err) {
		return
	}
	a, err := r.AnswerConsole(host, c.GetId())
	done()
	if !assert.NoError(t, err) {
		return
	}
	assert.True(t, a.Deliver(ctx, &eitriv1.ConsoleRequest{Data: []byte(data), Boot: "b1"}))
	a.Deliver(ctx, &eitriv1.ConsoleRequest{Done: true})
}

func TestAConsoleCallMeetsItsAnswer(t *testing.T) {
	r := New(Config{Hosts: hosts{instance: map[string]string{"h1": "agent-a"}}, Calls: &postbox{}})
	ctx := context.Background()

	_, err := r.OpenCalls(ctx, "h1", "agent-b")
	assert.Equal(t, Precondition, kind(err), "another agent process than the one holding the host gets no calls")
	line, err := r.OpenCalls(ctx, "h1", "agent-a")
	require.NoError(t, err)
	defer line.Close()

	go answer(t, r, line, "h1", "login: ")
	var got []string
	err = r.StreamConsole(ctx, to("h1"), &eitriv1.StreamConsoleRequest{VmId: "vm-1", NoFollow: true}, func(m *eitriv1.StreamConsoleResponse) error {
		got = append(got, string(m.GetData()))
		return nil
	})
	require.NoError(t, err)
	assert.Equal(t, []string{"login: "}, got)

	_, err = r.OpenAnswer("h1")
	assert.Equal(t, NotFound, kind(err), "with no call waiting, a host may open no answer stream")
}

func TestACallToAHostHeldByAnotherReplicaGoesThroughTheDatabase(t *testing.T) {
	box := &postbox{}
	r := New(Config{Hosts: hosts{elsewhere: map[string]bool{"h2": true}}, Calls: box, AdvertiseURL: "https://cp1:8443"})
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	err := r.StreamConsole(ctx, to("h2"), &eitriv1.StreamConsoleRequest{VmId: "vm-2"}, func(*eitriv1.StreamConsoleResponse) error { return nil })
	require.ErrorIs(t, err, context.DeadlineExceeded, "nobody answered")
	box.mu.Lock()
	defer box.mu.Unlock()
	require.Len(t, box.posted, 1)
	assert.Equal(t, "h2", box.posted[0].HostID)
	assert.Equal(t, []string{box.posted[0].ID}, box.dropped, "a call nobody answered is taken back")

	// A replica without an advertise URL has nowhere for the host to answer.
	r = New(Config{Hosts: hosts{elsewhere: map[string]bool{"h2": true}}, Calls: box})
	err = r.SendConsoleInput(context.Background(), to("h2"), &eitriv1.SendConsoleInputRequest{VmId: "vm-2", Data: []byte("x")})
	assert.Equal(t, Unavailable, kind(err))
	assert.Contains(t, err.Error(), "--advertise-url")
}

func TestTakeCallsSendsPostedCallsDownTheHostsLine(t *testing.T) {
	box := &postbox{}
	r := New(Config{Hosts: hosts{instance: map[string]string{"h1": "a"}}, Calls: box})
	line, err := r.OpenCalls(context.Background(), "h1", "a")
	require.NoError(t, err)
	defer line.Close()
	b := []byte{} // an empty CallsResponse
	box.posted = []store.PostedCall{{ID: "call-x", HostID: "h1", Call: b}, {ID: "call-y", HostID: "h9", Call: b}}
	r.TakeCalls(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	_, err = line.Next(ctx)
	require.NoError(t, err, "the call for the host held here went down its line")
	assert.Len(t, box.posted, 1, "a call for a host held elsewhere is left for its holder")
}

func TestConsoleInputIsBoundedPerUser(t *testing.T) {
	var h calls
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for range inputBurst / MaxConsoleInput {
		require.NoError(t, h.allowInput("u1", MaxConsoleInput, now))
	}
	err := h.allowInput("u1", MaxConsoleInput, now)
	assert.Equal(t, Exhausted, kind(err), "past the burst, input waits for the bucket to refill")
	assert.NoError(t, h.allowInput("u2", MaxConsoleInput, now), "another user's allowance is their own")
	assert.NoError(t, h.allowInput("u1", MaxConsoleInput, now.Add(time.Second)), "a second refills 16 KiB")

	done, err := h.startTyping("vm-1")
	require.NoError(t, err)
	_, err = h.startTyping("vm-1")
	assert.Equal(t, Exhausted, kind(err), "one input call at a time per vm")
	done()
	_, err = h.startTyping("vm-1")
	assert.NoError(t, err)
}
