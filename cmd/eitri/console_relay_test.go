package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/connclient"
)

// The console relay without a guest, through the API: the agent's real
// relay over a real QEMU backend whose VM has a serial log the test writes
// (the QEMU side runs in the console e2e test). It lives here, where the
// control plane and the agent are composed, because server code and its
// tests import no agent code.
func TestTheConsoleIsRelayedByTheVMsHostOnly(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	ctx := context.Background()
	hc := connclient.HTTPClient("")
	vms := eitriv1connect.NewVMServiceClient(hc, e.url, connect.WithInterceptors(connclient.Bearer(e.srv.AdminToken)))
	code := connect.CodeOf
	mkVM := func(name, host string) string {
		r, err := vms.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{Name: name, HostId: host,
			ImageUrl: "http://images.test/g.raw", ImageSha256: strings.Repeat("ab", 32), Vcpus: 1, MemMb: 256, DiskGb: 1}))
		require.NoError(t, err)
		return r.Msg.Vm.Id
	}

	e.connectHost("quiet")
	t.Run("a host that does not relay says so", func(t *testing.T) {
		quiet := mkVM("quiet-1", hostIDOf(t, e, "quiet"))
		_, err := vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: quiet, Data: []byte("x")}))
		assert.Equal(t, connect.CodeUnavailable, code(err), "%v", err)
		assert.Contains(t, err.Error(), "does not relay consoles")
	})

	qb, ident := e.consoleHost("h1")
	id := mkVM("con", ident.HostID)
	log := filepath.Join(qb.VMDir(id), "serial.log")
	require.NoError(t, os.MkdirAll(qb.VMDir(id), 0o700))
	require.NoError(t, os.WriteFile(log, []byte("booting...\n"), 0o600))

	var mu sync.Mutex
	var out bytes.Buffer
	sctx, stopStream := context.WithCancel(ctx)
	defer stopStream()
	var st *connect.ServerStreamForClient[eitriv1.StreamConsoleResponse]
	var err error
	require.Eventually(t, func() bool {
		st, err = vms.StreamConsole(sctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: id}))
		if err != nil {
			return false
		}
		if st.Receive() {
			return true
		}
		return false
	}, 10*time.Second, 20*time.Millisecond, "the relay connects")
	out.Write(st.Msg().GetData())
	go func() {
		for st.Receive() {
			mu.Lock()
			out.Write(st.Msg().GetData())
			mu.Unlock()
		}
	}()
	f, err := os.OpenFile(log, os.O_WRONLY|os.O_APPEND, 0)
	require.NoError(t, err)
	_, err = f.WriteString("login: ")
	require.NoError(t, err)
	require.NoError(t, f.Close())
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return out.String() == "booting...\nlogin: " }, 10*time.Second, 20*time.Millisecond,
		"the log's tail, then what is written, arrive")

	t.Run("without following, the stream ends after the output so far", func(t *testing.T) {
		st, err := vms.StreamConsole(ctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: id, NoFollow: true}))
		require.NoError(t, err)
		var got bytes.Buffer
		for st.Receive() {
			got.Write(st.Msg().GetData())
		}
		require.NoError(t, st.Err())
		assert.Equal(t, "booting...\nlogin: ", got.String())
	})

	t.Run("input to a VM whose QEMU is not running is refused by its host", func(t *testing.T) {
		_, err := vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: []byte("root\r")}))
		assert.Equal(t, connect.CodeFailedPrecondition, code(err), "%v", err)
		assert.Contains(t, err.Error(), "not running")
	})

	t.Run("bad input names the field", func(t *testing.T) {
		for _, data := range [][]byte{nil, bytes.Repeat([]byte("x"), 4097)} {
			_, err := vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: data}))
			assert.Equal(t, connect.CodeInvalidArgument, code(err), "%v", err)
			assert.Contains(t, err.Error(), "data:")
		}
		for _, req := range []*eitriv1.StreamConsoleRequest{
			{VmId: id, TailBytes: 2 << 20}, {VmId: id, Offset: -1}, {VmId: id, Boot: strings.Repeat("b", 200)},
		} {
			st, err := vms.StreamConsole(ctx, connect.NewRequest(req))
			require.NoError(t, err)
			assert.False(t, st.Receive())
			assert.Equal(t, connect.CodeInvalidArgument, code(st.Err()), "%v", st.Err())
		}
	})

	t.Run("another user's VM is not found", func(t *testing.T) {
		tokens := eitriv1connect.NewTokenServiceClient(hc, e.url, connect.WithInterceptors(connclient.Bearer(e.srv.AdminToken)))
		tok, err := tokens.CreateToken(ctx, connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "t", UserName: "mallory"}))
		require.NoError(t, err)
		other := eitriv1connect.NewVMServiceClient(hc, e.url, connect.WithInterceptors(connclient.Bearer(tok.Msg.Secret)))
		st, err := other.StreamConsole(ctx, connect.NewRequest(&eitriv1.StreamConsoleRequest{VmId: id}))
		require.NoError(t, err)
		assert.False(t, st.Receive())
		assert.Equal(t, connect.CodeNotFound, code(st.Err()), "%v", st.Err())
		_, err = other.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: []byte("x")}))
		assert.Equal(t, connect.CodeNotFound, code(err), "%v", err)
	})

	t.Run("typing faster than the allowance is refused", func(t *testing.T) {
		// The allowance is 64 KiB at once, the other cases spent a little.
		var last error
		for range 17 {
			_, last = vms.SendConsoleInput(ctx, connect.NewRequest(&eitriv1.SendConsoleInputRequest{VmId: id, Data: bytes.Repeat([]byte("y"), 4096)}))
			if code(last) == connect.CodeResourceExhausted {
				break
			}
		}
		assert.Equal(t, connect.CodeResourceExhausted, code(last), "%v", last)
	})

	t.Run("another agent process with the host's identity gets no calls", func(t *testing.T) {
		ac := eitriv1connect.NewAgentServiceClient(hc, e.url, connect.WithInterceptors(connclient.Bearer(ident.Credential)))
		calls, err := ac.Calls(ctx, connect.NewRequest(&eitriv1.CallsRequest{InstanceId: "agent-clone"}))
		require.NoError(t, err)
		assert.False(t, calls.Receive())
		assert.Equal(t, connect.CodeFailedPrecondition, code(calls.Err()), "%v", calls.Err())
	})

	t.Run("a host cannot answer a call it was not sent", func(t *testing.T) {
		ac := eitriv1connect.NewAgentServiceClient(hc, e.url, connect.WithInterceptors(connclient.Bearer(ident.Credential)))
		c := ac.Console(ctx)
		// The stream is refused before its first message is read, so the
		// send may find it closed already (io.EOF); Receive has the answer.
		if err := c.Send(&eitriv1.ConsoleRequest{CallId: "call-made-up"}); err != nil {
			require.ErrorIs(t, err, io.EOF)
		}
		_, err := c.Receive()
		assert.Equal(t, connect.CodeNotFound, code(err), "%v", err)
	})
}

// hostIDOf is the id of the host enrolled under name.
func hostIDOf(t *testing.T, e *cliEnv, name string) string {
	t.Helper()
	r, err := e.srv.Fleet.ListHosts(e.adminCtx())
	require.NoError(t, err)
	for _, h := range r {
		if h.GetName() == name {
			return h.GetId()
		}
	}
	t.Fatalf("no host named %s", name)
	return ""
}
