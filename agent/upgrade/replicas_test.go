package upgrade_test

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/upgrade"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/release"
)

// replica is one control-plane replica serving the build over h2c, as the
// dev control plane does; die, when set, makes it go away halfway through
// its first answer (its listener and every connection closed).
type replica struct {
	*httptest.Server
	mu       sync.Mutex
	requests []string // each request's Range header
}

func serveReplica(t *testing.T, data []byte, die bool) *replica {
	t.Helper()
	rp := &replica{}
	rp.Server = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != "Bearer host-cred" {
			http.Error(w, "no", http.StatusUnauthorized)
			return
		}
		rp.mu.Lock()
		rp.requests = append(rp.requests, r.Header.Get("Range"))
		rp.mu.Unlock()
		if die {
			// Gone for good before the answer is cut: the resumed request
			// can only land on another replica.
			_ = rp.Listener.Close()
			w.Header().Set("Content-Length", fmt.Sprint(len(data)))
			_, _ = w.Write(data[:len(data)/2])
			w.(http.Flusher).Flush()
			rp.CloseClientConnections()
			return
		}
		http.ServeContent(w, r, "", time.Time{}, bytes.NewReader(data))
	}))
	rp.Config.Protocols = new(http.Protocols)
	rp.Config.Protocols.SetHTTP1(true)
	rp.Config.Protocols.SetUnencryptedHTTP2(true)
	rp.Start()
	t.Cleanup(rp.Close)
	return rp
}

func (rp *replica) seen() []string {
	rp.mu.Lock()
	defer rp.mu.Unlock()
	return append([]string(nil), rp.requests...)
}

// downURL is a control-plane URL nothing answers at.
func downURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := l.Addr().String()
	require.NoError(t, l.Close())
	return "http://" + addr
}

// replicaHost is an agent of one control plane at urls, fetching through
// the client every agent call shares; requests name the first URL.
func replicaHost(t *testing.T, key release.PublicKey, urls []string) *host {
	t.Helper()
	hc, base, err := connclient.Replicas("", urls)
	require.NoError(t, err)
	return newHostWith(t, key, hc, base)
}

func TestTheBuildIsFetchedFromAnotherReplicaWhenTheFirstIsDown(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.4.0")
	up := serveReplica(t, build, false)
	h := replicaHost(t, pub, []string{downURL(t), up.URL})

	var r *upgrade.Restart
	require.ErrorAs(t, h.take(t, offer(t, priv, "v1.4.0", build)), &r, "status: %v", h.u.Status())
	assert.Equal(t, []string{""}, up.seen(), "one whole download from the replica that answers")
	got, err := os.ReadFile(h.exe)
	require.NoError(t, err)
	assert.Equal(t, build, got)
}

func TestADownloadCutOffByADeadReplicaResumesOnAnother(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	build := script("v1.4.0")
	dying := serveReplica(t, build, true)
	up := serveReplica(t, build, false)
	h := replicaHost(t, pub, []string{dying.URL, up.URL})

	var r *upgrade.Restart
	require.ErrorAs(t, h.take(t, offer(t, priv, "v1.4.0", build)), &r, "status: %v", h.u.Status())
	assert.Equal(t, []string{""}, dying.seen())
	// The close resets the connection, and a reset drops what the host had
	// not read yet: it resumes from at most the half sent, from nothing if
	// nothing got through.
	seen := up.seen()
	require.Len(t, seen, 1, "one request to the other replica")
	if seen[0] != "" {
		var from int
		_, err = fmt.Sscanf(seen[0], "bytes=%d-", &from)
		require.NoError(t, err, "%q", seen[0])
		assert.True(t, from > 0 && from <= len(build)/2, "resumed from %d of %d", from, len(build))
	}
	got, err := os.ReadFile(h.exe)
	require.NoError(t, err)
	assert.Equal(t, build, got)
}
