package api_test

// Attacks on the HTTP surface, replayed: one request must not cost the
// control plane gigabytes, or a connection minutes, and every response
// carries the headers that keep the console's page its own. Each runs the
// real handler over real HTTP (HTTP/2 over TLS via httptest, or Serve on a
// loopback listener) and fails if the attack works.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/a73x/eitri/bench/hardening/bomb"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/api"
)

// bodyProbe counts the request body bytes anything behind it reads: the
// guard, Connect, a handler.
type bodyProbe struct{ read atomic.Int64 }

type probedBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b probedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

func (p *bodyProbe) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		r.Body = probedBody{r.Body, &p.read}
		h.ServeHTTP(w, r)
	})
}

// probedEnv is newEnv (HTTP/2 over TLS) with every request body probed.
func probedEnv(t *testing.T, cfg server.Config) (*env, *bodyProbe) {
	t.Helper()
	cfg.DataDir, cfg.Plaintext = t.TempDir(), true
	cfg.DeleteGrace = time.Hour
	s, err := server.New(context.Background(), cfg)
	require.NoError(t, err)
	probe := &bodyProbe{}
	ts := httptest.NewUnstartedServer(probe.wrap(s.Handler()))
	ts.EnableHTTP2 = true
	ts.StartTLS()
	t.Cleanup(func() { ts.Close(); s.Close() })
	return &env{t: t, srv: s, url: ts.URL, http: ts.Client(), admin: s.AdminToken, dir: cfg.DataDir}, probe
}

// served is a control plane run by Serve on a loopback listener (h2c and
// HTTP/1.1), so the server's own timeouts apply.
type served struct {
	*env
	addr string
	h1   *http.Client
}

func serve(t *testing.T, cfg server.Config) *served {
	t.Helper()
	cfg.DataDir, cfg.Plaintext = t.TempDir(), true
	s, err := server.New(context.Background(), cfg)
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(ctx, ln) }()
	t.Cleanup(func() { cancel(); <-done; s.Close() })
	h2 := &http.Transport{Protocols: new(http.Protocols)}
	h2.Protocols.SetUnencryptedHTTP2(true)
	h1 := &http.Transport{Protocols: new(http.Protocols)}
	h1.Protocols.SetHTTP1(true)
	addr := ln.Addr().String()
	return &served{
		env:  &env{t: t, srv: s, url: "http://" + addr, http: &http.Client{Transport: h2}, admin: s.AdminToken, dir: cfg.DataDir},
		addr: addr, h1: &http.Client{Transport: h1},
	}
}

// envelope frames one message as gRPC, gRPC-Web and Connect streaming do;
// flag 1 marks it compressed.
func envelope(flag byte, msg []byte) []byte {
	b := binary.BigEndian.AppendUint32([]byte{flag}, uint32(len(msg)))
	return append(b, msg...)
}

// wire is one way of sending a compressed request body.
type wire struct {
	name   string
	header http.Header
	body   func(gz []byte) []byte
}

var (
	connectUnary = wire{"connect", http.Header{"Content-Type": {"application/proto"}, "Content-Encoding": {"gzip"}},
		func(gz []byte) []byte { return gz }}
	connectStream = wire{"connect-stream", http.Header{"Content-Type": {"application/connect+proto"}, "Connect-Content-Encoding": {"gzip"}},
		func(gz []byte) []byte { return envelope(1, gz) }}
	grpc = wire{"grpc", http.Header{"Content-Type": {"application/grpc"}, "Grpc-Encoding": {"gzip"}, "Te": {"trailers"}},
		func(gz []byte) []byte { return envelope(1, gz) }}
	grpcWeb = wire{"grpc-web", http.Header{"Content-Type": {"application/grpc-web+proto"}, "Grpc-Encoding": {"gzip"}},
		func(gz []byte) []byte { return envelope(1, gz) }}
	plainJSON = wire{"json", http.Header{"Content-Type": {"application/json"}, "Content-Encoding": {"gzip"}},
		func(gz []byte) []byte { return gz }}
)

// outcome is how a request ended: the RPC code (or the JSON error's code)
// and the HTTP status.
type outcome struct {
	status  int
	code    string
	message string
}

// send posts body to path with hdr, reads the whole answer and decodes its
// error in whatever protocol it came. chunked hides the length, as an
// attacker streaming a body would.
func send(t *testing.T, c *http.Client, url, path string, hdr http.Header, body []byte, chunked bool) outcome {
	t.Helper()
	var r io.Reader = bytes.NewReader(body)
	if chunked {
		r = io.MultiReader(r) // not a *bytes.Reader: no Content-Length
	}
	req, err := http.NewRequest(http.MethodPost, url+path, r)
	require.NoError(t, err)
	for k, vs := range hdr {
		req.Header[k] = vs
	}
	resp, err := c.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	out := outcome{status: resp.StatusCode}
	ct := resp.Header.Get("Content-Type")
	switch {
	case strings.HasPrefix(ct, "application/grpc"):
		st := cmpOr(resp.Header.Get("Grpc-Status"), resp.Trailer.Get("Grpc-Status"))
		n, _ := strconv.Atoi(st)
		out.code = connect.Code(n).String()
		out.message = cmpOr(resp.Header.Get("Grpc-Message"), resp.Trailer.Get("Grpc-Message"))
	case strings.HasPrefix(ct, "application/connect+"):
		// The end-of-stream frame: {"error": {"code", "message"}}.
		for len(raw) >= 5 {
			n := binary.BigEndian.Uint32(raw[1:5])
			frame := raw[5 : 5+n]
			if raw[0]&2 != 0 {
				var end struct {
					Error struct{ Code, Message string }
				}
				_ = json.Unmarshal(frame, &end)
				out.code, out.message = end.Error.Code, end.Error.Message
			}
			raw = raw[5+n:]
		}
	default:
		var e struct{ Code, Message string }
		_ = json.Unmarshal(raw, &e)
		out.code, out.message = e.Code, e.Message
	}
	return out
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func allocated() uint64 {
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.TotalAlloc
}

// A 1 MiB gzip body that inflates to a gigabyte, sent with no credential or
// a wrong one, to every route that needs one and in every protocol. Anyone
// can send it, so the token is checked before a byte of the body is read:
// a body inflated first costs the server a gigabyte per request, whoever
// sent it.
func TestUnauthenticatedGzipBombIsRefusedUnread(t *testing.T) {
	e, probe := probedEnv(t, server.Config{})
	gz, inflated := bomb.Gzip(1 << 20)
	require.Greater(t, inflated, int64(1<<30)-(64<<20))
	pat, _ := e.userToken("alice", 0)

	cases := []struct {
		path  string
		wire  wire
		creds []string // Authorization values; "" sends none
	}{
		{eitriv1connect.VMServiceCreateVMProcedure, connectUnary, []string{"", "Bearer eitri_pat_nope", "Basic YWRtaW4="}},
		{eitriv1connect.VMServiceCreateVMProcedure, grpc, []string{"", "Bearer eitri_pat_nope"}},
		{eitriv1connect.VMServiceWatchVMsProcedure, grpcWeb, []string{"", "Bearer eitri_pat_nope"}},
		{eitriv1connect.TokenServiceCreateTokenProcedure, connectUnary, []string{"", "Bearer eitri_ses_nope"}},
		// The agent's stream takes host credentials only: a user's token is
		// as good as none.
		{eitriv1connect.AgentServiceSyncProcedure, connectStream, []string{"", "Bearer eitri_host_nope", "Bearer " + pat}},
		{eitriv1connect.AgentServiceSyncProcedure, grpc, []string{"", "Bearer eitri_host_nope"}},
		{"/mcp", plainJSON, []string{"", "Bearer eitri_pat_nope"}},
	}
	before := allocated()
	n := 0
	for _, c := range cases {
		for _, cred := range c.creds {
			for _, chunked := range []bool{false, true} {
				hdr := c.wire.header.Clone()
				if cred != "" {
					hdr.Set("Authorization", cred)
				}
				probe.read.Store(0)
				got := send(t, e.http, e.url, c.path, hdr, c.wire.body(gz), chunked)
				what := fmt.Sprintf("%s over %s with %q (chunked %v)", c.path, c.wire.name, cred, chunked)
				assert.Equal(t, "unauthenticated", got.code, "%s: %+v", what, got)
				assert.Zero(t, probe.read.Load(), "%s: not one byte of the body is read", what)
				n++
			}
		}
	}
	grew := allocated() - before
	t.Logf("%d bombs of %d KiB (each %d MiB inflated): %.1f MiB allocated in all, client included", n, len(gz)>>10, inflated>>20, float64(grew)/(1<<20))
	assert.Less(t, grew, uint64(n)*4<<20, "a few MiB per bomb at most; one inflated alone would be 1 GiB")
}

// The same bomb on the routes anyone may call, where no header can refuse it:
// Enroll (its join token is in the body), /auth/login (a token in the body),
// the console and /healthz. Their
// bodies are small by nature, so a large one is refused from its
// Content-Length before a byte is read; one that hides its length is cut off
// at the bound and never inflated past the message limit.
func TestGzipBombOnAnOpenRouteIsRefusedUnread(t *testing.T) {
	e, probe := probedEnv(t, server.Config{})
	gz, _ := bomb.Gzip(1 << 20)

	for _, c := range []struct {
		path   string
		wire   wire
		status int
		code   string
	}{
		{eitriv1connect.AgentServiceEnrollProcedure, connectUnary, http.StatusTooManyRequests, "resource_exhausted"}, // Connect's HTTP status for the code
		{eitriv1connect.AgentServiceEnrollProcedure, grpc, http.StatusOK, "resource_exhausted"},
		{"/auth/login", plainJSON, http.StatusRequestEntityTooLarge, "resource_exhausted"},
		{"/", plainJSON, http.StatusRequestEntityTooLarge, "resource_exhausted"},
		{"/healthz", plainJSON, http.StatusRequestEntityTooLarge, "resource_exhausted"},
	} {
		probe.read.Store(0)
		got := send(t, e.http, e.url, c.path, c.wire.header, c.wire.body(gz), false)
		assert.Equal(t, c.status, got.status, c.path)
		assert.Equal(t, c.code, got.code, c.path)
		assert.Contains(t, got.message, "over the limit", c.path)
		assert.Zero(t, probe.read.Load(), "%s: not one byte of the body is read", c.path)
	}

	// Without a length: read up to the bound (17 KiB), never more.
	probe.read.Store(0)
	got := send(t, e.http, e.url, eitriv1connect.AgentServiceEnrollProcedure, connectUnary.header, gz, true)
	assert.Equal(t, "resource_exhausted", got.code)
	assert.LessOrEqual(t, probe.read.Load(), int64(api.MaxEnrollMessage+api.EnvelopeSlack+32<<10), "at most the bound, and what was in flight")

	// Small enough to pass the byte bound, still a bomb: 16 KiB that
	// inflates to 16 MiB stops inflating at the 16 KiB message limit.
	small, inflated := bomb.Gzip(api.MaxEnrollMessage)
	before := allocated()
	got = send(t, e.http, e.url, eitriv1connect.AgentServiceEnrollProcedure, connectUnary.header, small, false)
	assert.Equal(t, "resource_exhausted", got.code, "%+v", got)
	assert.Contains(t, got.message, "larger than configured max 16384")
	assert.Contains(t, got.message, "inflates past the limit")
	assert.Less(t, allocated()-before, uint64(inflated/4), "not inflated to the end")
}

// A caller with a valid token is still held to the body bound, and is told
// what the bound is (ResourceExhausted), however the body is sent, so an
// honest client that sends too much can see why.
func TestOversizedAuthenticatedCallIsResourceExhausted(t *testing.T) {
	e, probe := probedEnv(t, server.Config{})
	key := "ssh-ed25519 " + strings.Repeat("A", 100<<10)
	req := createReq("web-1")
	req.SshAuthorizedKey = key

	for _, c := range []struct {
		name string
		opts []connect.ClientOption
		says string
	}{
		{"connect", nil, "over the limit of 66560 bytes"}, // from its Content-Length, unread
		{"grpc", []connect.ClientOption{connect.WithGRPC()}, ""},
		{"connect+gzip", []connect.ClientOption{connect.WithSendGzip()}, "larger than configured max 65536"},
		{"grpc+gzip", []connect.ClientOption{connect.WithGRPC(), connect.WithSendGzip()}, "larger than configured max 65536"},
	} {
		vms := eitriv1connect.NewVMServiceClient(e.http, e.url, append(c.opts, bearer(e.admin))...)
		_, err := vms.CreateVM(context.Background(), connect.NewRequest(req))
		require.Error(t, err)
		t.Logf("%s: %v", c.name, err)
		assert.Equal(t, connect.CodeResourceExhausted, connect.CodeOf(err), "%s: %v", c.name, err)
		if c.says != "" {
			assert.Contains(t, err.Error(), c.says, c.name)
		}
	}

	// An authenticated bomb: 64 KiB that inflates to 64 MiB stops at the
	// 64 KiB message limit.
	gz, inflated := bomb.Gzip(api.MaxUserMessage)
	hdr := connectUnary.header.Clone()
	hdr.Set("Authorization", "Bearer "+e.admin)
	before := allocated()
	probe.read.Store(0)
	got := send(t, e.http, e.url, eitriv1connect.VMServiceCreateVMProcedure, hdr, gz, true)
	assert.Equal(t, "resource_exhausted", got.code, "%+v", got)
	assert.Contains(t, got.message, "inflates past the limit")
	assert.Less(t, allocated()-before, uint64(inflated/4), "not inflated to the end")

	// The same call within bounds still works.
	req.SshAuthorizedKey = ""
	_, err := e.vms(e.admin).CreateVM(context.Background(), connect.NewRequest(req))
	assert.NotEqual(t, connect.CodeResourceExhausted, connect.CodeOf(err), "%v", err)
}

// A host's credential may be stolen, or its agent compromised: one Sync
// frame that inflates to a gigabyte is cut off at the report limit (8 MiB)
// and the stream fails, quickly: Connect alone would inflate it to the end
// to say how large it was.
func TestHostGzipBombOnSyncIsCutOffAtTheReportLimit(t *testing.T) {
	e, _ := probedEnv(t, server.Config{})
	_, cred := e.enroll("h1")
	gz, _ := bomb.Gzip(1 << 20)
	hdr := grpc.header.Clone()
	hdr.Set("Authorization", "Bearer "+cred)
	before := allocated()
	got := send(t, e.http, e.url, eitriv1connect.AgentServiceSyncProcedure, hdr, grpc.body(gz), true)
	assert.Equal(t, "resource_exhausted", got.code, "%+v", got)
	assert.Contains(t, got.message, fmt.Sprint(api.MaxReportMessage))
	// Our reader's words, not Connect's: Connect's own limit is checked only
	// after it has inflated the whole frame to learn its size.
	assert.Contains(t, got.message, "inflates past the limit")
	assert.Less(t, allocated()-before, uint64(8*api.MaxReportMessage), "a few reports' worth, not a gigabyte")
}

// The bound leaves room for the biggest real hosts: a report carrying 2,000
// quarantined VMs with their specs (over 2 MiB) lands.
func TestALargeHostsReportStillFits(t *testing.T) {
	e := serve(t, server.Config{}) // with Serve's small HTTP/2 windows
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	rep := &eitriv1.ActualStateReport{Capacity: &eitriv1.Capacity{Vcpus: 64, MemMb: 1 << 20, DiskGb: 10000}}
	for i := range 2000 {
		rep.Quarantined = append(rep.Quarantined, &eitriv1.QuarantinedVM{
			VmId: fmt.Sprintf("vm-%06d", i), Name: fmt.Sprintf("web-%d", i),
			VmspecJson: bytes.Repeat([]byte("s"), 1024), DestroyAtUnix: time.Now().Add(time.Hour).Unix(),
		})
	}
	require.Greater(t, proto.Size(rep), 2<<20)
	a.report(t, rep)
	require.Eventually(t, func() bool {
		return e.host(h).GetCapacity().GetVcpus() == 64
	}, 5*time.Second, 10*time.Millisecond, "the report lands")
}

// A body trickled one byte at a time holds a connection (and a goroutine)
// for as long as the sender likes, so a few thousand cost the server its
// connections: the body must be in within the body timeout, on an open route
// (Enroll, login) over HTTP/1.1 and on an authenticated call over HTTP/2.
func TestTrickledBodyIsCutOffAtTheBodyTimeout(t *testing.T) {
	const timeout = time.Second
	s := serve(t, server.Config{BodyTimeout: timeout})

	for _, path := range []string{eitriv1connect.AgentServiceEnrollProcedure, "/auth/login"} {
		conn, err := net.Dial("tcp", s.addr)
		require.NoError(t, err)
		_, err = fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n{", path)
		require.NoError(t, err)
		start := time.Now()
		closed := make(chan time.Duration, 1)
		answer := make(chan []byte, 1)
		go func() {
			b, _ := io.ReadAll(conn) // until the server hangs up
			closed <- time.Since(start)
			answer <- b
		}()
		trickle := time.NewTicker(100 * time.Millisecond)
		giveUp := time.After(timeout + 2*time.Second)
	wait:
		for {
			select {
			case d := <-closed:
				t.Logf("%s over HTTP/1.1: closed after %s", path, d.Round(time.Millisecond))
				assert.GreaterOrEqual(t, d, timeout-100*time.Millisecond, path)
				b := <-answer
				assert.Contains(t, string(b), "Connection: close", path)
				if path == eitriv1connect.AgentServiceEnrollProcedure {
					assert.Contains(t, string(b), "the request body did not arrive within 1s", path)
				}
				break wait
			case <-trickle.C:
				_, _ = conn.Write([]byte(" "))
			case <-giveUp:
				t.Fatalf("%s: a trickled body still holds the connection after %s", path, time.Since(start))
			}
		}
		trickle.Stop()
		conn.Close()
	}

	// HTTP/2, with a valid token: the stream fails, the connection lives on.
	pr, pw := io.Pipe()
	go func() {
		for {
			if _, err := pw.Write([]byte{0}); err != nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()
	defer pw.Close()
	req, _ := http.NewRequest(http.MethodPost, s.url+eitriv1connect.VMServiceCreateVMProcedure, pr)
	req.Header.Set("Content-Type", "application/proto")
	req.Header.Set("Authorization", "Bearer "+s.admin)
	start := time.Now()
	resp, err := s.http.Do(req)
	if err == nil {
		_, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	d := time.Since(start)
	t.Logf("CreateVM over HTTP/2: ended after %s (%v, status %v)", d.Round(time.Millisecond), err, resp.StatusCode)
	assert.Less(t, d, timeout+2*time.Second, "the trickled call ends")
	assert.GreaterOrEqual(t, d, timeout-100*time.Millisecond)
}

// watchConn remembers when the server closed a client connection.
type watchConn struct {
	net.Conn
	closed chan struct{}
	once   *atomic.Bool
}

func (c watchConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil && c.once.CompareAndSwap(false, true) {
		close(c.closed)
	}
	return n, err
}

// An idle keep-alive connection costs the server a socket for nothing, and
// anyone can open thousands: it is closed after the idle timeout, over
// HTTP/1.1 and HTTP/2.
func TestIdleKeepAliveIsClosedAfterTheIdleTimeout(t *testing.T) {
	const idle = time.Second
	s := serve(t, server.Config{IdleTimeout: idle})

	conn, err := net.Dial("tcp", s.addr)
	require.NoError(t, err)
	defer conn.Close()
	_, err = fmt.Fprintf(conn, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
	require.NoError(t, err)
	br := bufio.NewReader(conn)
	resp, err := http.ReadResponse(br, nil)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.False(t, resp.Close, "a keep-alive connection")
	start := time.Now()
	_ = conn.SetReadDeadline(time.Now().Add(idle + 3*time.Second))
	_, err = br.ReadByte()
	require.ErrorIs(t, err, io.EOF, "the server hangs up rather than the deadline firing")
	t.Logf("HTTP/1.1 keep-alive closed after %s idle", time.Since(start).Round(time.Millisecond))

	// HTTP/2: one request, then nothing.
	closed := make(chan struct{})
	tr := &http.Transport{Protocols: new(http.Protocols), DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return watchConn{Conn: c, closed: closed, once: new(atomic.Bool)}, nil
	}}
	tr.Protocols.SetUnencryptedHTTP2(true)
	defer tr.CloseIdleConnections()
	resp, err = (&http.Client{Transport: tr}).Get(s.url + "/healthz")
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	require.Equal(t, 2, resp.ProtoMajor)
	start = time.Now()
	select {
	case <-closed:
		t.Logf("HTTP/2 connection closed after %s idle", time.Since(start).Round(time.Millisecond))
	case <-time.After(idle + 3*time.Second):
		t.Fatal("an idle HTTP/2 connection is still open")
	}
}

// The timeouts must not cut what is meant to last: a console's Watch
// streams (HTTP/2 and, from an old browser, HTTP/1.1) and an agent's Sync
// stream outlive both, and still deliver.
func TestStreamsOutliveTheBodyAndIdleTimeouts(t *testing.T) {
	const timeout = 500 * time.Millisecond
	s := serve(t, server.Config{BodyTimeout: timeout, IdleTimeout: timeout})
	h, cred := s.enroll("h1")
	a := s.connect(h, cred, big())

	type watch struct {
		name string
		got  chan *eitriv1.WatchVMsResponse
	}
	var watches []watch
	for _, w := range []struct {
		name string
		c    *http.Client
	}{{"HTTP/2", s.http}, {"HTTP/1.1", s.h1}} {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		st, err := eitriv1connect.NewVMServiceClient(w.c, s.url, bearer(s.admin)).WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
		require.NoError(t, err)
		ch := make(chan *eitriv1.WatchVMsResponse, 16)
		go func() {
			defer close(ch)
			for st.Receive() {
				ch <- st.Msg()
			}
		}()
		<-ch // the starting list
		watches = append(watches, watch{w.name, ch})
	}

	time.Sleep(4 * timeout)
	vm, err := s.vms(s.admin).CreateVM(context.Background(), connect.NewRequest(createReq("web-1")))
	require.NoError(t, err)
	for _, w := range watches {
		select {
		case m, ok := <-w.got:
			require.True(t, ok, "%s: the watch stream ended", w.name)
			assert.Equal(t, vm.Msg.Vm.Id, m.GetChanged().GetId(), w.name)
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: the watch stream delivered nothing", w.name)
		}
	}
	snap := a.next(t)
	for snap.GetVms() == nil {
		snap = a.next(t)
	}
	assert.Equal(t, vm.Msg.Vm.Id, snap.GetVms()[0].GetVmId(), "the agent's stream still delivers")
}

// The console holds a signed-in session, so no other site may frame it
// (clickjacking) and no response may be sniffed into a script; it runs only
// its own scripts, so an injected one cannot act for whoever is signed in:
// the one inline script SvelteKit's static build boots from is allowed by
// its hash, no other inline script. (That the real console still runs under
// this policy was checked in Chromium.)
func TestConsoleAndAPIResponsesForbidFramingAndSniffing(t *testing.T) {
	const boot = "\n\t\t\t\t{\n\t\t\t\t\t__sveltekit_x = { base: \"\" };\n\t\t\t\t\tPromise.all([import(\"/_app/immutable/entry/start.js\")]);\n\t\t\t\t}\n\t\t\t"
	page := `<!doctype html><html><head><link href="/_app/immutable/entry/start.js" rel="modulepreload"></head>` +
		`<body><div style="display: contents"><script>` + boot + `</script></div></body></html>`
	console := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, ".js") {
			w.Header().Set("Content-Type", "text/javascript")
			_, _ = w.Write([]byte("export {}"))
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = w.Write([]byte(page))
	})
	e, _ := probedEnv(t, server.Config{Console: console})
	hash := func(s string) string {
		sum := sha256.Sum256([]byte(s))
		return "'sha256-" + base64.StdEncoding.EncodeToString(sum[:]) + "'"
	}

	get := func(path string) http.Header {
		resp, err := e.http.Get(e.url + path)
		require.NoError(t, err)
		resp.Body.Close()
		return resp.Header
	}
	for _, path := range []string{"/", "/vms/vm-1", "/_app/immutable/entry/start.js"} {
		h := get(path)
		assert.Equal(t, "DENY", h.Get("X-Frame-Options"), path)
		assert.Equal(t, "nosniff", h.Get("X-Content-Type-Options"), path)
		csp := h.Get("Content-Security-Policy")
		assert.Contains(t, csp, "frame-ancestors 'none'", path)
		assert.Contains(t, csp, "default-src 'none'", path)
		assert.Contains(t, csp, "script-src 'self' "+hash(boot)+";", path)
		assert.Contains(t, csp, "style-src 'self';", path)
		assert.NotContains(t, csp, "script-src 'unsafe-inline'", path)
		assert.NotContains(t, csp, "unsafe-eval", path)
	}

	// Everything else is no page at all.
	for _, h := range []http.Header{get("/healthz"), get("/auth/me")} {
		assert.Equal(t, "DENY", h.Get("X-Frame-Options"))
		assert.Equal(t, "nosniff", h.Get("X-Content-Type-Options"))
		assert.Equal(t, "default-src 'none'; frame-ancestors 'none'", h.Get("Content-Security-Policy"))
	}
	_, err := e.vms(e.admin).ListVMs(context.Background(), connect.NewRequest(&eitriv1.ListVMsRequest{}))
	require.NoError(t, err)
}
