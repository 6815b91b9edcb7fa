package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/agent/syncclient"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/wire/jointoken"
)

// cliOnServer runs eitri's client commands against a real control plane over h2c,
// as a person with EITRI_URL and EITRI_TOKEN set would.
func cliOnServer(t *testing.T) func(args ...string) (string, error) {
	t.Helper()
	return newCLIEnv(t, server.Config{}).eitri
}

// cliEnv is a real control plane the CLI talks to, for tests that also
// need to reach behind the CLI (the fleet, the store, an enrolled host).
type cliEnv struct {
	t     *testing.T
	srv   *server.Server
	url   string
	admin auth.Principal
}

// newCLIEnv serves cfg (its data dir and plaintext are set here) over h2c
// on loopback and points EITRI_URL and EITRI_TOKEN at it.
func newCLIEnv(t *testing.T, cfg server.Config) *cliEnv {
	t.Helper()
	cfg.DataDir, cfg.Plaintext = t.TempDir(), true
	srv, err := server.New(context.Background(), cfg)
	require.NoError(t, err)
	ts := httptest.NewUnstartedServer(srv.Handler())
	ts.Config.Protocols = new(http.Protocols)
	ts.Config.Protocols.SetHTTP1(true)
	ts.Config.Protocols.SetUnencryptedHTTP2(true) // the CLI speaks h2c to http:// URLs
	ts.Start()
	t.Cleanup(func() { ts.Close(); srv.Close() })
	t.Setenv("EITRI_URL", ts.URL)
	t.Setenv("EITRI_TOKEN", srv.AdminToken)
	// A login saved on this machine is not the test's.
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	p, err := srv.Fleet.Resolve(context.Background(), srv.AdminToken)
	require.NoError(t, err)
	return &cliEnv{t: t, srv: srv, url: ts.URL, admin: p}
}

// eitri runs one CLI command and returns what it printed.
func (e *cliEnv) eitri(args ...string) (string, error) {
	var out bytes.Buffer
	err := run(args, &out)
	return out.String(), err
}

// adminCtx is a request context acting as the first admin.
func (e *cliEnv) adminCtx() context.Context {
	return auth.WithPrincipal(context.Background(), e.admin)
}

// enroll enrolls a host named name. The join token names the public URL,
// which the test server does not know, so it is pointed at where the
// server really listens.
func (e *cliEnv) enroll(name string) state.Identity {
	e.t.Helper()
	jt, err := e.srv.Fleet.CreateJoinToken(e.adminCtx(), time.Minute)
	require.NoError(e.t, err)
	tok, err := jointoken.Decode(jt.Token)
	require.NoError(e.t, err)
	tok.Url = e.url
	id, err := syncclient.Enroll(context.Background(), jointoken.Encode(tok), name, "test")
	require.NoError(e.t, err)
	return id
}

func TestTheCLISpeaksTheAPI(t *testing.T) {
	eitri := cliOnServer(t)

	out, err := eitri("token", "create", "laptop", "--ttl", "24h")
	require.NoError(t, err)
	assert.Contains(t, out, "eitri_pat_", "the secret is shown once")

	out, err = eitri("token", "ls")
	require.NoError(t, err)
	assert.Contains(t, out, "laptop")

	_, err = eitri("vm", "create", "Bad_Name", "--image", "http://x/y.raw", "--sha256", "00")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "invalid argument: name:", "the server's message, naming the field, reaches the terminal")

	_, err = eitri("vm", "create", "web-1", "--image", "http://x/y.raw", "--sha256", "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "failed precondition: no connected host")

	out, err = eitri("host", "join-token", "-o", "json")
	require.NoError(t, err)
	var jt map[string]any
	require.NoError(t, json.Unmarshal([]byte(out), &jt), out)
	assert.Contains(t, jt["command"], "eitri agent --join eitri_join_")

	out, err = eitri("vm", "ls", "-o", "json")
	require.NoError(t, err)
	assert.JSONEq(t, `{"vms":[]}`, out)

	_, err = eitri("vm", "get")
	var ue cli.UsageError
	assert.ErrorAs(t, err, &ue, "a missing argument is a usage error")
}
