package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/a73x/eitri/agent"
	"github.com/a73x/eitri/agent/consolerelay"
	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/agent/syncclient"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/connclient"
)

// What a host holds, through the CLI, the real control plane, and the
// agent's real cache report, sync stream and call relay over a real image
// cache and VM records: only the VMs and pulls are scripted. It lives here,
// where the control plane and the agent are composed.
func TestHostImagesListsWhatTheHostHoldsAndPruneRemovesOnlyWhatNothingWants(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	cache := imagecache.New(t.TempDir(), imagecache.WithDialPolicy(imagecache.AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}))
	var shas []string
	for i, size := range []int{48 << 10, 64 << 10, 80 << 10} {
		b := bytes.Repeat([]byte{byte(i + 1), 7, 9}, size/3)
		ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write(b) }))
		sum := sha256.Sum256(b)
		shas = append(shas, hex.EncodeToString(sum[:]))
		_, err := cache.Ensure(context.Background(), ts.URL+"/img.raw", shas[i], nil)
		ts.Close()
		require.NoError(t, err)
	}
	pulled, forVM, unused := shas[0], shas[1], shas[2]
	st, err := state.Open(filepath.Join(t.TempDir(), "state"))
	require.NoError(t, err)

	// The host: scripted VMs and pulls, the real cache report and relay.
	id := e.enroll("h1")
	report := agent.CacheReport{Cache: cache, State: st, Log: slog.Default()}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	hc := connclient.HTTPClient("")
	go func() {
		_ = syncclient.Run(ctx, syncclient.Config{Identity: id, Source: &scriptedHost{id: id}, ReportEvery: 10 * time.Millisecond, Client: hc,
			Hello:      func() *eitriv1.Hello { return &eitriv1.Hello{AgentVersion: "test", InstanceId: "agent-1"} },
			ImageCache: report.Report, ImageCacheChanged: report.Changed(ctx)})
	}()
	go func() {
		_ = consolerelay.Run(ctx, consolerelay.Config{Client: hc, Identity: id, InstanceID: "agent-1", PruneImages: report.Prune})
	}()

	out, err := e.eitri("image", "add", "tools", "--url", "http://images.test/tools.raw", "--sha256", pulled)
	require.NoError(t, err, out)
	out, err = e.eitri("image", "add", "debian-12", "--url", "http://images.test/debian.raw", "--sha256", forVM)
	require.NoError(t, err, out)
	out, err = e.eitri("image", "pull", "tools", "--host", "h1")
	require.NoError(t, err, out)
	out, err = e.eitri("vm", "create", "web-1", "--image", "debian-12", "-o", "json")
	require.NoError(t, err, out)
	var created eitriv1.CreateVMResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &created), out)
	// The host made the VM from the image, and holds the pull pinned: the
	// pin is the cache's change, so the listing goes out with both.
	require.NoError(t, st.SaveVM(created.Vm.Id, state.Record{Spec: state.VMSpec{ID: created.Vm.Id, Name: "web-1", ImageSHA256: forVM}}))
	cache.Acquire(pulled)

	require.Eventually(t, func() bool {
		out, err = e.eitri("host", "images", "h1")
		return err == nil && bytes.Contains([]byte(out), []byte("web-1")) && bytes.Contains([]byte(out), []byte("pull of tools"))
	}, 10*time.Second, 20*time.Millisecond, "the host's listing lands")
	t.Logf("\n%s", out)
	assert.Regexp(t, pulled[:12]+`…\s+\S+ KiB\s+.*\s+pull of tools\s+—\s+tools v1 \(current\)`, out)
	assert.Regexp(t, forVM[:12]+`…\s+.*\s+no\s+web-1\s+debian-12 v1 \(current\)`, out)
	assert.Regexp(t, unused[:12]+`…\s+.*\s+no\s+—\s+—`, out)
	assert.Contains(t, out, "3 image(s)")

	freed := allocated(t, cache.Path(unused))
	out, err = e.eitri("host", "images", "h1", "--prune", "-o", "json")
	require.NoError(t, err, out)
	var pr eitriv1.PruneHostImagesResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &pr), out)
	require.Len(t, pr.Removed, 1, out)
	assert.Equal(t, unused, pr.Removed[0].Sha256)
	assert.Equal(t, uint64(freed), pr.FreedBytes)
	assert.NoFileExists(t, cache.Path(unused))
	assert.FileExists(t, cache.Path(pulled))
	assert.FileExists(t, cache.Path(forVM))

	out, err = e.eitri("host", "images", "h1", "--prune")
	require.NoError(t, err, out)
	assert.Equal(t, "nothing to prune on h1: every cached image is pinned or backs a VM\n", out)
	require.Eventually(t, func() bool {
		out, err = e.eitri("host", "images", "h1")
		return err == nil && !bytes.Contains([]byte(out), []byte(unused[:12]))
	}, 10*time.Second, 20*time.Millisecond, "the listing drops what was pruned")
	assert.Contains(t, out, "2 image(s)")
}

func allocated(t *testing.T, path string) int64 {
	t.Helper()
	ims, err := imagecache.New(filepath.Dir(path)).Images()
	require.NoError(t, err)
	for _, im := range ims {
		if filepath.Join(filepath.Dir(path), im.SHA256+".raw") == path {
			return im.Bytes
		}
	}
	t.Fatalf("%s is not in the cache", path)
	return 0
}
