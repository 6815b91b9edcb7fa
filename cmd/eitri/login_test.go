package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/server"
)

// eitriIn runs one command line with stdin and returns its stdout.
func eitriIn(stdin string, args ...string) (string, error) {
	var out bytes.Buffer
	err := execute(context.Background(), args, cli.IO{In: strings.NewReader(stdin), Out: &out, Err: &bytes.Buffer{}})
	return out.String(), err
}

// loggedOut clears the environment's credentials, so only a saved login
// (in a config dir of the test's own) can point commands anywhere.
func loggedOut(t *testing.T) string {
	t.Helper()
	t.Setenv("EITRI_URL", "")
	t.Setenv("EITRI_TOKEN", "")
	t.Setenv("EITRI_FINGERPRINT", "")
	dir := t.TempDir()
	t.Setenv("XDG_CONFIG_HOME", dir)
	return filepath.Join(dir, "eitri", "config.json")
}

func TestLoginSavesTheControlPlaneAndLaterCommandsUseIt(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	other := newCLIEnv(t, server.Config{}) // a second control plane, for EITRI_URL
	path := loggedOut(t)

	_, err := eitriIn("", "vm", "ls")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "eitri login", "with nothing saved, the error says what to do")

	_, err = eitriIn("", "login", e.url, "--token", "eitri_pat_wrong")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "did not accept the token (nothing saved): unauthenticated")
	assert.NoFileExists(t, path)

	out, err := eitriIn("", "login", e.url+"/", "--token", e.srv.AdminToken)
	require.NoError(t, err)
	assert.Contains(t, out, "logged in to "+e.url+" as admin")
	st, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), st.Mode().Perm(), "the token is readable by its user only")
	dir, err := os.Stat(filepath.Dir(path))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), dir.Mode().Perm())
	var saved map[string]string
	b, _ := os.ReadFile(path)
	require.NoError(t, json.Unmarshal(b, &saved))
	assert.Equal(t, map[string]string{"url": e.url, "token": e.srv.AdminToken}, saved, "no trailing slash; no pin for http")

	out, err = eitriIn("", "host", "ls")
	require.NoError(t, err, "a later command uses the saved login")
	assert.Contains(t, out, "CONNECTED")

	// The environment overrides the saved login.
	t.Setenv("EITRI_TOKEN", "eitri_pat_revoked")
	_, err = eitriIn("", "host", "ls")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "unauthenticated", "EITRI_TOKEN wins over the saved token")
	t.Setenv("EITRI_TOKEN", "")
	t.Setenv("EITRI_URL", other.url)
	_, err = eitriIn("", "host", "ls")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no token for "+other.url, "the saved token is never sent to another control plane")
	t.Setenv("EITRI_TOKEN", other.srv.AdminToken)
	_, err = eitriIn("", "host", "ls")
	require.NoError(t, err, "EITRI_URL and EITRI_TOKEN together point anywhere")
	t.Setenv("EITRI_URL", "")
	t.Setenv("EITRI_TOKEN", "")

	// A login others may read is refused, as ssh refuses such a key.
	require.NoError(t, os.Chmod(path, 0o644))
	_, err = eitriIn("", "host", "ls")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "others may read it (mode 0644)")
	require.NoError(t, os.Chmod(path, 0o600))

	out, err = eitriIn("", "logout")
	require.NoError(t, err)
	assert.Contains(t, out, "logged out of "+e.url)
	assert.NoFileExists(t, path)
	_, err = eitriIn("", "host", "ls")
	require.Error(t, err)

	// The token may come on stdin (eitri login URL < file), or from EITRI_TOKEN.
	out, err = eitriIn(e.srv.AdminToken+"\n", "login", e.url)
	require.NoError(t, err)
	assert.Contains(t, out, "as admin")
	_, err = eitriIn("", "logout")
	require.NoError(t, err)
	t.Setenv("EITRI_TOKEN", e.srv.AdminToken)
	_, err = eitriIn("", "login", e.url)
	require.NoError(t, err)
	t.Setenv("EITRI_TOKEN", "")
	_, err = eitriIn("", "host", "ls")
	require.NoError(t, err)

	for _, bad := range []string{"ftp://x", "127.0.0.1:8080", "http://", "http://x?y=1"} {
		_, err := eitriIn("", "login", bad, "--token", "t")
		var ue cli.UsageError
		assert.ErrorAs(t, err, &ue, bad)
	}
}

// tlsControlPlane serves a control plane over TLS with its self-made
// certificate, as eitri server does.
func tlsControlPlane(t *testing.T) (url string, srv *server.Server) {
	t.Helper()
	srv, err := server.New(context.Background(), server.Config{DataDir: t.TempDir(), PublicURL: "https://127.0.0.1"})
	require.NoError(t, err)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = srv.Serve(ctx, ln); close(done) }()
	t.Cleanup(func() { cancel(); <-done; srv.Close() })
	return "https://" + ln.Addr().String(), srv
}

func TestLoginPinsTheCertificateOfAnHTTPSControlPlane(t *testing.T) {
	url, srv := tlsControlPlane(t)
	path := loggedOut(t)

	// No CA here vouches for the self-made certificate, and nobody is at a
	// terminal to confirm it: the fingerprint is shown, nothing saved.
	_, err := eitriIn("", "login", url, "--token", srv.AdminToken)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "pass --fingerprint "+srv.Fingerprint)
	assert.NoFileExists(t, path)

	wrong := strings.Repeat("0", 64)
	_, err = eitriIn("", "login", url, "--token", srv.AdminToken, "--fingerprint", wrong)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "presents a certificate with fingerprint "+srv.Fingerprint+", not the "+wrong)
	assert.NoFileExists(t, path)

	out, err := eitriIn("", "login", url, "--token", srv.AdminToken, "--fingerprint", strings.ToUpper(srv.Fingerprint))
	require.NoError(t, err)
	assert.Contains(t, out, "logged in to "+url)
	var saved map[string]string
	b, _ := os.ReadFile(path)
	require.NoError(t, json.Unmarshal(b, &saved))
	assert.Equal(t, srv.Fingerprint, saved["fingerprint"])

	out, err = eitriIn("", "quota", "get")
	require.NoError(t, err, "later commands speak TLS pinned to the saved fingerprint")
	assert.Contains(t, out, "quota of admin")

	// A pin that no longer matches is refused, as agents refuse it.
	t.Setenv("EITRI_FINGERPRINT", wrong)
	_, err = eitriIn("", "quota", "get")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "does not match the pinned")
}

func TestLoginToSeveralReplicasFailsOverToOneThatAnswers(t *testing.T) {
	live, srv := tlsControlPlane(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	down := "https://" + ln.Addr().String()
	require.NoError(t, ln.Close()) // a replica that is down
	path := loggedOut(t)

	out, err := eitriIn("", "login", down+","+live, "--token", srv.AdminToken, "--fingerprint", srv.Fingerprint)
	require.Error(t, err, "the pin is checked on the first replica, which must answer at login")
	assert.Contains(t, err.Error(), "cannot reach "+down)

	out, err = eitriIn("", "login", live+","+down, "--token", srv.AdminToken, "--fingerprint", srv.Fingerprint)
	require.NoError(t, err)
	assert.Contains(t, out, "logged in to "+live+", "+down)
	var saved struct{ Replicas []string }
	b, _ := os.ReadFile(path)
	require.NoError(t, json.Unmarshal(b, &saved))
	assert.Equal(t, []string{live, down}, saved.Replicas)

	// Commands fail over: with the order reversed in EITRI_URL (the dead
	// one first), the request still reaches the live replica.
	t.Setenv("EITRI_URL", down+","+live)
	t.Setenv("EITRI_TOKEN", srv.AdminToken)
	t.Setenv("EITRI_FINGERPRINT", srv.Fingerprint)
	out, err = eitriIn("", "quota", "get")
	require.NoError(t, err)
	assert.Contains(t, out, "quota of admin")
}

func TestLoginRefusesReplicasThatPresentDifferentCertificates(t *testing.T) {
	a, srv := tlsControlPlane(t)
	b, _ := tlsControlPlane(t) // another control plane, its own certificate
	path := loggedOut(t)
	_, err := eitriIn("", "login", a+","+b, "--token", srv.AdminToken, "--fingerprint", srv.Fingerprint)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "replicas must share one certificate")
	assert.NoFileExists(t, path)

	_, err = eitriIn("", "login", a+",http://127.0.0.1:1", "--token", srv.AdminToken)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "same scheme")
}
