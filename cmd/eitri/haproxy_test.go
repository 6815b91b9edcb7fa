package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/server"
)

// shippedHAProxy is the load balancer config the README points to.
var shippedHAProxy = filepath.Join("..", "..", "deploy", "haproxy", "haproxy.cfg")

func needHAProxy(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("haproxy")
	if err != nil {
		t.Skip("needs Debian's haproxy (apt-get install haproxy)")
	}
	return bin
}

func TestTheShippedHAProxyConfigIsValid(t *testing.T) {
	bin := needHAProxy(t)
	out, err := exec.Command(bin, "-c", "-f", shippedHAProxy).CombinedOutput()
	require.NoError(t, err, "%s", out)
	assert.Contains(t, string(out), "Configuration file is valid")
}

// TestTheCLIReachesReplicasThroughTheShippedHAProxyConfig runs the shipped
// config, with its addresses swapped for loopback ones, in front of one
// control plane served at two addresses: the pinned TLS and HTTP/2 pass
// through, and with one replica gone the other answers.
func TestTheCLIReachesReplicasThroughTheShippedHAProxyConfig(t *testing.T) {
	bin := needHAProxy(t)
	lnA, lnB := loopback(t), loopback(t)
	frontAddr := freeAddr(t) // haproxy binds it

	srv, err := server.New(context.Background(), server.Config{DataDir: t.TempDir(), PublicURL: "https://" + frontAddr})
	require.NoError(t, err)
	t.Cleanup(func() { srv.Close() })
	stopA := serveOn(srv, lnA)
	t.Cleanup(serveOn(srv, lnB))

	b, err := os.ReadFile(shippedHAProxy)
	require.NoError(t, err)
	cfg := strings.Replace(string(b), "bind :7443", "bind "+frontAddr, 1)
	// An unprivileged process cannot raise its descriptor limit to what the
	// production maxconn asks for.
	cfg = strings.Replace(cfg, "maxconn 20000", "maxconn 1000", 1)
	servers := regexp.MustCompile(`(?m)^\s*server .*$\n?`)
	cfg = servers.ReplaceAllString(cfg, "")
	cfg += "    server cp1 " + lnA.Addr().String() + "\n    server cp2 " + lnB.Addr().String() + "\n"
	// t.TempDir's parent is private to root; the unprivileged haproxy
	// must read its config.
	dir, err := os.MkdirTemp("", "eitri-haproxy-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.Chmod(dir, 0o755))
	path := filepath.Join(dir, "haproxy.cfg")
	require.NoError(t, os.WriteFile(path, []byte(cfg), 0o644))

	cmd := exec.Command(bin, "-db", "-f", path)
	if os.Geteuid() == 0 {
		// As an unprivileged user, never as a system service.
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	}
	var logs hosttest.LogBuffer // written by exec's copier while the test reads it
	cmd.Stdout, cmd.Stderr = &logs, &logs
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })

	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	t.Setenv("EITRI_URL", "https://"+frontAddr)
	t.Setenv("EITRI_TOKEN", srv.AdminToken)
	t.Setenv("EITRI_FINGERPRINT", srv.Fingerprint)
	quota := func() error {
		out, err := eitriIn("", "quota", "get")
		if err == nil && !strings.Contains(out, "quota of admin") {
			t.Fatalf("unexpected answer: %s", out)
		}
		return err
	}
	require.Eventually(t, func() bool { return quota() == nil }, 10*time.Second, 50*time.Millisecond, "through haproxy: %s", &logs)
	stopA()
	for range 6 { // leastconn and redispatch: every try lands on B
		require.NoError(t, quota(), "with cp1 gone: %s", &logs)
	}
}
