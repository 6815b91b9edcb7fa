package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// consoleReader collects what a StreamConsole stream delivers.
type consoleReader struct {
	mu     sync.Mutex
	out    bytes.Buffer
	msgs   []*eitriv1.StreamConsoleResponse
	opened chan struct{}
	err    error
	done   chan struct{}
}

func readConsole(ctx context.Context, t *testing.T, vms eitriv1connect.VMServiceClient, req *eitriv1.StreamConsoleRequest) *consoleReader {
	t.Helper()
	st, err := vms.StreamConsole(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	c := &consoleReader{opened: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(c.done)
		first := true
		for st.Receive() {
			c.mu.Lock()
			c.out.Write(st.Msg().GetData())
			c.msgs = append(c.msgs, st.Msg())
			c.mu.Unlock()
			if first {
				close(c.opened)
				first = false
			}
		}
		c.mu.Lock()
		c.err = st.Err()
		c.mu.Unlock()
	}()
	return c
}

func (c *consoleReader) waitOpen(t *testing.T) {
	t.Helper()
	select {
	case <-c.opened:
	case <-c.done:
		t.Fatalf("the console stream ended before its first message: %v", c.err)
	case <-time.After(time.Minute):
		t.Fatal("the console stream did not open")
	}
}

func (c *consoleReader) text() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.out.String()
}

func TestTheSerialConsoleIsRelayedLiveAndTakesInput(t *testing.T) {
	if !inNetns(t) {
		return
	}
	dir := t.TempDir()
	imgURL, imgSum := serveFile(t, os.Getenv("EITRI_GUEST_IMAGE"))
	dev := startDev(t, dir)
	defer func() { dev.stop(t) }()
	vms := dev.vms(t, dir)
	ctx := context.Background()

	created, err := vms.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{
		Name: "con-1", ImageUrl: imgURL, ImageSha256: imgSum, Vcpus: 1, MemMb: 256, DiskGb: 1}))
	require.NoError(t, err)
	id := created.Msg.Vm.Id

	// Opened before the guest has written anything: what arrives later
	// came live.
	sctx, stop := context.WithCancel(ctx)
	defer stop()
	live := readConsole(sctx, t, vms, &eitriv1.StreamConsoleRequest{VmId: id})
	live.waitOpen(t)
	require.Eventually(t, func() bool { return strings.Contains(live.text(), "EITRI-GUEST-READY") }, 4*time.Minute, 100*time.Millisecond,
		"the guest's ready line arrives on the open stream")

	// The guest's console is a tty in echo mode: what is typed comes back.
	const word = "eitri-typed-4242"
	_, err = vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: []byte(word + "\r")}))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return strings.Contains(live.text(), word) }, time.Minute, 100*time.Millisecond,
		"the input is echoed on the stream")

	// A resume from where the stream is names the same boot and repeats
	// nothing.
	live.mu.Lock()
	lastMsg := live.msgs[len(live.msgs)-1]
	live.mu.Unlock()
	end := lastMsg.Offset + int64(len(lastMsg.Data))
	rctx, rstop := context.WithCancel(ctx)
	resumed := readConsole(rctx, t, vms, &eitriv1.StreamConsoleRequest{VmId: id, Boot: lastMsg.Boot, Offset: end})
	resumed.waitOpen(t)
	_, err = vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: []byte("again\r")}))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return strings.Contains(resumed.text(), "again") }, time.Minute, 100*time.Millisecond)
	assert.NotContains(t, resumed.text(), word, "a resumed stream starts where the last one ended")
	rstop()

	// Bounds, and other users.
	_, err = vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: bytes.Repeat([]byte("x"), 4097)}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	assert.Contains(t, err.Error(), "data")
	_, err = vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id}))
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(err), "%v", err)
	st, err := vms.StreamConsole(ctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: id, TailBytes: 2 << 20}))
	require.NoError(t, err)
	require.False(t, st.Receive())
	require.Equal(t, connect.CodeInvalidArgument, connect.CodeOf(st.Err()))
	assert.Contains(t, st.Err().Error(), "tail_bytes")

	other := otherUser(t, dir, "mallory")
	st, err = other.StreamConsole(ctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: id}))
	require.NoError(t, err)
	require.False(t, st.Receive(), "another user reads nothing")
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(st.Err()), "%v", st.Err())
	_, err = other.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: []byte("x")}))
	require.Equal(t, connect.CodeNotFound, connect.CodeOf(err), "another user types nothing: %v", err)

	// A stopped VM's console is still read (a boot that died can be); it
	// takes no input.
	stop()
	_, err = vms.StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: id}))
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		_, err := vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: []byte("x")}))
		return connect.CodeOf(err) == connect.CodeFailedPrecondition
	}, 2*time.Minute, 500*time.Millisecond, "a stopped VM's console takes no input")
	tctx, tstop := context.WithCancel(ctx)
	defer tstop()
	after := readConsole(tctx, t, vms, &eitriv1.StreamConsoleRequest{VmId: id})
	require.Eventually(t, func() bool { return strings.Contains(after.text(), "EITRI-GUEST-READY") }, 30*time.Second, 100*time.Millisecond,
		"the last boot's output is read back after the VM stopped")
}

// otherUser is a VM client for a second, non-admin user.
func otherUser(t *testing.T, dir, name string) eitriv1connect.VMServiceClient {
	t.Helper()
	tokenBytes, err := os.ReadFile(dir + "/control/admin.token")
	require.NoError(t, err)
	hc := connclient.HTTPClient("")
	base := "http://127.0.0.1:18080"
	admin := connect.WithInterceptors(connclient.Bearer(strings.TrimSpace(string(tokenBytes))))
	tok, err := eitriv1connect.NewTokenServiceClient(hc, base, admin).CreateToken(context.Background(),
		connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "t", UserName: name}))
	require.NoError(t, err)
	return eitriv1connect.NewVMServiceClient(hc, base, connect.WithInterceptors(connclient.Bearer(tok.Msg.Secret)))
}
