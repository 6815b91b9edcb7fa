package pki

import (
	"crypto/tls"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestFirstStartMakesACertificateAndLaterStartsKeepIt(t *testing.T) {
	dir := t.TempDir()
	a, err := LoadOrCreate(dir, []string{"cp.example", "10.1.2.3"})
	require.NoError(t, err)
	assert.Contains(t, a.Leaf.DNSNames, "cp.example")
	b, err := LoadOrCreate(dir, nil)
	require.NoError(t, err)
	assert.Equal(t, Fingerprint(a.Certificate[0]), Fingerprint(b.Certificate[0]), "a restart must not change the pinned identity")
}

func TestPinnedClientTrustsOnlyThePinnedCertificate(t *testing.T) {
	cert, err := LoadOrCreate(t.TempDir(), nil)
	require.NoError(t, err)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) }))
	srv.TLS = &tls.Config{Certificates: []tls.Certificate{cert}}
	srv.StartTLS()
	defer srv.Close()

	get := func(fp string) error {
		c := &http.Client{Transport: &http.Transport{TLSClientConfig: PinnedConfig(fp)}}
		resp, err := c.Get(srv.URL)
		if err == nil {
			resp.Body.Close()
		}
		return err
	}
	require.NoError(t, get(Fingerprint(cert.Certificate[0])))
	err = get("00" + Fingerprint(cert.Certificate[0])[2:])
	require.Error(t, err)
	assert.Contains(t, err.Error(), "does not match the pinned")
}
