package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/agent/imagecache"
)

func TestImageAllowFlag(t *testing.T) {
	var a agentFlags
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	fs.SetOutput(io.Discard)
	a.register(fs)
	require.NoError(t, fs.Parse([]string{"--image-allow", "192.168.77.0/24, 10.1.2.3/8", "--image-allow", "fd00::1,127.0.0.1"}))
	want := []netip.Prefix{
		netip.MustParsePrefix("192.168.77.0/24"), netip.MustParsePrefix("10.0.0.0/8"),
		netip.MustParsePrefix("fd00::1/128"), netip.MustParsePrefix("127.0.0.1/32"),
	}
	assert.Equal(t, want, []netip.Prefix(a.imageAllow))
	assert.Equal(t, want, a.imagePolicy().Allow)
	for _, bad := range []string{"10.0.0.0/33", "images.example", "10.0.0", "/8"} {
		assert.Error(t, (&prefixList{}).Set(bad), bad)
	}
	var none agentFlags
	none.register(pflag.NewFlagSet("agent", pflag.ContinueOnError))
	assert.Empty(t, none.imagePolicy().Allow, "public addresses only unless told")
}

// The attack, in eitri dev: image_url pointing at the dev server's own API
// on the same loopback port, at its other routes, or at another loopback
// service. Dev mode's agent reaches its own /guest-image/ and nothing else
// on loopback unless --image-allow says so.
func TestSSRFDevModeReachesOnlyItsOwnGuestImage(t *testing.T) {
	guestDir := t.TempDir()
	guest := []byte(strings.Repeat("a tiny test guest ", 4096))
	sum := sha256.Sum256(guest)
	require.NoError(t, os.WriteFile(filepath.Join(guestDir, "eitri-guest.raw"), guest, 0o644))
	require.NoError(t, os.WriteFile(filepath.Join(guestDir, "eitri-guest.raw.sha256"), []byte(hex.EncodeToString(sum[:])+"  eitri-guest.raw\n"), 0o644))

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	base := "http://" + ln.Addr().String()
	var apiHits atomic.Int64
	r := chi.NewRouter()
	serveGuestImage(r, guestDir, base)
	// Stands in for the control plane's API on the same port.
	r.HandleFunc("/eitri.v1.VMService/*", func(w http.ResponseWriter, _ *http.Request) {
		apiHits.Add(1)
		fmt.Fprint(w, "SECRET")
	})
	srv := &http.Server{Handler: r}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { srv.Close() })

	var otherHits atomic.Int64
	other := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		otherHits.Add(1)
		w.Write(guest)
	}))
	t.Cleanup(other.Close)

	devAgent := func(args ...string) *imagecache.Cache {
		var a agentFlags
		fs := pflag.NewFlagSet("dev", pflag.ContinueOnError)
		a.register(fs)
		require.NoError(t, fs.Parse(args))
		a.imageEndpoints = guestImageEndpoints(ln.Addr())
		return imagecache.New(t.TempDir(), imagecache.WithDialPolicy(a.imagePolicy()))
	}
	digest := hex.EncodeToString(sum[:])

	// The quickstart: the URL /guest-image.json advertises downloads.
	resp, err := http.Get(base + "/guest-image.json")
	require.NoError(t, err)
	var preset struct{ URL, SHA256 string }
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&preset))
	resp.Body.Close()
	require.Equal(t, base+"/guest-image/eitri-guest.raw", preset.URL)
	p, err := devAgent().Ensure(context.Background(), preset.URL, preset.SHA256, nil)
	require.NoError(t, err)
	assert.FileExists(t, p)

	_, otherPort, _ := net.SplitHostPort(other.Listener.Addr().String())
	for _, u := range []string{
		base + "/eitri.v1.VMService/ListVMs",
		base + "/guest-image.json",
		base + "/guest-image/../eitri.v1.VMService/ListVMs",
		base + "/guest-image/%2e%2e/eitri.v1.VMService/ListVMs",
		other.URL + "/guest-image/eitri-guest.raw",
		"http://localhost:" + otherPort + "/guest-image/eitri-guest.raw",
	} {
		t.Run(u, func(t *testing.T) {
			_, err := devAgent().Ensure(context.Background(), u, digest, nil)
			require.Error(t, err)
			refused, ok := errors.AsType[*imagecache.RefusedAddressError](err)
			require.True(t, ok, "want a refusal, got %v", err)
			assert.True(t, refused.Addr.IsLoopback())
			assert.Contains(t, err.Error(), "is not allowed for image downloads (loopback")
			assert.Contains(t, err.Error(), "an operator can allow it with --image-allow")
			assert.NotContains(t, err.Error(), "SECRET")
		})
	}
	assert.Zero(t, apiHits.Load(), "the API was never reached")
	assert.Zero(t, otherHits.Load(), "the other loopback service was never reached")

	// What --image-allow names is admitted on top.
	_, err = devAgent("--image-allow", "127.0.0.1/32").Ensure(context.Background(), other.URL+"/img", digest, nil)
	require.NoError(t, err)
	assert.Equal(t, int64(1), otherHits.Load())
}
