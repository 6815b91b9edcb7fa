package netsetup

import (
	"context"
	"net/http"
	"net/netip"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/hosttest"
)

// A guest fetches its own renewed host certificate from the bridge, and
// no guest gets another's.
func TestAGuestFetchesItsOwnHostCertificateOnTheBridge(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		ctx := context.Background()
		linkUp(t, "lo")
		var mu sync.Mutex
		certs := map[string]string{"vm-1": "ssh-ed25519-cert-v01@openssh.com AAAA-one", "vm-2": "ssh-ed25519-cert-v01@openssh.com AAAA-two"}
		cfg := Config{LeaseFile: filepath.Join(t.TempDir(), "leases.json"), DNS: []netip.Addr{netip.MustParseAddr("192.0.2.53")},
			Log: hosttest.Logger(t), HostCerts: func(vmID string) string { mu.Lock(); defer mu.Unlock(); return certs[vmID] }}
		n, inGuest := guestOnBridge(t, cfg)
		get := func(url string) (int, string) {
			req, err := http.NewRequest(http.MethodGet, url, nil)
			require.NoError(t, err)
			return guestHTTP(t, inGuest, n.Gateway(), req)
		}
		url1 := n.HostCertURL("vm-1")
		require.True(t, strings.HasPrefix(url1, "http://10.77.0.1:7480/eitri/host-cert/vm-1/"), url1)
		status, body := get(url1)
		assert.Equal(t, http.StatusOK, status)
		assert.Equal(t, "ssh-ed25519-cert-v01@openssh.com AAAA-one\n", body, "its own certificate")
		status, body = get(n.HostCertURL("vm-2"))
		assert.Equal(t, http.StatusNotFound, status, "vm-2's from vm-1's address")
		assert.NotContains(t, body, "AAAA-two")
		status, _ = get(url1[:len(url1)-1] + "x")
		assert.Equal(t, http.StatusNotFound, status, "a wrong token")

		// No certificate (none made yet): the same 404, and the guest keeps
		// the one it has.
		mu.Lock()
		delete(certs, "vm-1")
		mu.Unlock()
		status, _ = get(url1)
		assert.Equal(t, http.StatusNotFound, status)

		require.NoError(t, n.Close())
		cfg.HostCerts = nil
		n, err := Setup(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(func() { n.Close() })
		assert.Empty(t, n.HostCertURL("vm-1"), "nothing serves certificates: guests are given no URL")
	})
}
