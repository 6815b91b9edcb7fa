package hostvm

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/agent/permanent"
	"github.com/a73x/eitri/agent/seed"
	"github.com/a73x/eitri/agent/seed/seedtest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/reconcile"
	"github.com/a73x/eitri/agent/state"
)

func TestCheckSpec(t *testing.T) {
	ok := state.VMSpec{ID: "vm1", VCPUs: 2, MemMB: 1024, DiskGB: 10}
	mem := func(n int64) func() (int64, error) { return func() (int64, error) { return n, nil } }
	unknownMem := func() (int64, error) { return 0, errors.New("no /proc") }
	with := func(f func(*state.VMSpec)) state.VMSpec { s := ok; f(&s); return s }

	tests := []struct {
		name    string
		spec    state.VMSpec
		cpus    int32
		mem     func() (int64, error)
		wantErr string
	}{
		{"fits", ok, 4, mem(4096), ""},
		{"exactly the host", with(func(s *state.VMSpec) { s.VCPUs, s.MemMB = 4, 4096 }), 4, mem(4096), ""},
		{"no vcpus", with(func(s *state.VMSpec) { s.VCPUs = 0 }), 4, mem(4096), "vcpus must be positive"},
		{"no memory", with(func(s *state.VMSpec) { s.MemMB = -1 }), 4, mem(4096), "memory must be positive"},
		{"no disk", with(func(s *state.VMSpec) { s.DiskGB = 0 }), 4, mem(4096), "disk must be positive"},
		{"more vcpus than CPUs", with(func(s *state.VMSpec) { s.VCPUs = 5 }), 4, mem(4096), "this host has 4 CPUs"},
		{"more memory than the host", with(func(s *state.VMSpec) { s.MemMB = 8192 }), 4, mem(4096), "this host has 4096 MiB"},
		{"host memory unknown", with(func(s *state.VMSpec) { s.MemMB = 1 << 30 }), 4, unknownMem, ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := checkSpec(tc.spec, tc.cpus, tc.mem)
			if tc.wantErr == "" {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.wantErr)
			assert.True(t, permanent.Is(err), "a spec the host can never run must fail at once")
		})
	}
}

func TestParseMemTotal(t *testing.T) {
	tests := []struct {
		name, in string
		want     int64
		wantErr  bool
	}{
		{"meminfo", "MemTotal:       24684544 kB\nMemFree:        23800000 kB\n", 24684544 >> 10, false},
		{"not first", "Foo: 1 kB\nMemTotal: 2097152 kB\n", 2048, false},
		{"missing", "MemFree: 1 kB\n", 0, true},
		{"odd unit", "MemTotal: 2 GB\n", 0, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseMemTotal(strings.NewReader(tc.in))
			if tc.wantErr {
				assert.Error(t, err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestCapacity(t *testing.T) {
	vcpus, memMB, diskGB, err := Capacity(t.TempDir())
	require.NoError(t, err)
	total, err := hostMemMB()
	require.NoError(t, err)
	assert.Positive(t, vcpus)
	assert.Positive(t, memMB)
	assert.Less(t, memMB, total, "the host keeps a reserve")
	assert.GreaterOrEqual(t, memMB, total-4096, "the reserve is at most 4 GiB")
	assert.Positive(t, diskGB)

	_, _, _, err = Capacity(filepath.Join(t.TempDir(), "missing"))
	assert.Error(t, err, "an unmeasurable disk is an error, never zero")
}

func TestMemReserve(t *testing.T) {
	assert.Equal(t, int64(512), memReserveMB(1024))
	assert.Equal(t, int64(1600), memReserveMB(16000))
	assert.Equal(t, int64(4096), memReserveMB(256000))
}

func TestWriteSeed(t *testing.T) {
	out := filepath.Join(t.TempDir(), "seed.iso")
	// A network that serves no phone-home endpoint: the seed asks for none.
	h := &Hypervisor{net: &netsetup.Network{}}
	caPub, _, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	ca, err := ssh.NewPublicKey(caPub)
	require.NoError(t, err)
	caLine := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(ca)))
	require.NoError(t, h.WriteSeed(out, reconcile.SeedParams{InstanceID: "vm-1", Hostname: "web-1", LoginUser: "eitri",
		TrustedUserCAKeys: []string{caLine}, UserCertPrincipal: "eitri@vm-1"}))

	_, files := seedtest.Read(t, out)
	require.Contains(t, files, "meta-data")
	assert.Contains(t, files["meta-data"], "web-1", "the hostname reaches the seed")
	assert.Contains(t, files["meta-data"], "vm-1", "the instance id reaches the seed")
	assert.Contains(t, files["user-data"], "- name: \"eitri\"", "the login user reaches the seed")
	assert.NotContains(t, files["user-data"], seed.PhoneHomeUnit, "no phone home without an endpoint")
	assert.Contains(t, files["user-data"], caLine, "the trusted user CA reaches the seed")
	assert.Contains(t, files["user-data"], "TrustedUserCAKeys ")

	err = h.WriteSeed(filepath.Join(t.TempDir(), "bad.iso"), reconcile.SeedParams{InstanceID: "vm-1", Hostname: "not a label"})
	require.Error(t, err)
	assert.True(t, permanent.Is(err), "a hostname the seed refuses never becomes valid on retry")
}

// allowLoopback lets the image cache fetch from the tests' loopback
// servers, as --image-allow would; by default it refuses loopback.
var allowLoopback = imagecache.WithDialPolicy(imagecache.AddressPolicy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}})

// serveImage serves body over loopback HTTP and returns its URL and digest.
func serveImage(t *testing.T, body []byte) (url, sha string) {
	t.Helper()
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(body)
	}))
	t.Cleanup(ts.Close)
	sum := sha256.Sum256(body)
	return ts.URL, hex.EncodeToString(sum[:])
}

// TestImagesPinUntilRootDisk: an image stays pinned in the cache from
// Resolve until PrepareRootDisk has linked it into the VM's disk; after
// that the cache may evict it and the disk keeps its base.
func TestImagesPinUntilReleased(t *testing.T) {
	hosttest.NeedQEMU(t)
	const size = 64 << 10
	var urls, shas []string
	for i := range 4 {
		u, s := serveImage(t, bytes.Repeat([]byte{byte(i + 1)}, size))
		urls, shas = append(urls, u), append(shas, s)
	}
	// Room for one image: each Ensure evicts every unpinned other.
	cache := imagecache.New(t.TempDir(), imagecache.WithMaxBytes(size+size/2), allowLoopback)
	im := NewImages(cache)
	b, err := qemu.New(qemu.Config{Dir: t.TempDir(), Log: hosttest.Logger(t)})
	require.NoError(t, err)
	h := &Hypervisor{qemu: b, images: im, log: hosttest.Logger(t), known: map[string]bool{}}
	ctx := context.Background()

	base, release, err := im.Resolve(ctx, urls[0], shas[0], nil)
	require.NoError(t, err)
	assert.Equal(t, 1, im.Pinned(shas[0]))
	_, releaseOther, err := im.Resolve(ctx, urls[1], shas[1], nil)
	require.NoError(t, err)
	releaseOther()
	assert.FileExists(t, base, "pinned until released, so not evicted")

	spec := state.VMSpec{ID: "vm1", ImageSHA256: shas[0], DiskGB: 1}
	require.NoError(t, h.PrepareRootDisk(ctx, spec, base))
	assert.Equal(t, 1, im.Pinned(shas[0]), "the root disk does not release what the engine holds")
	release()
	release() // a second release must not drop a pin someone else holds
	assert.Zero(t, im.Pinned(shas[0]))

	_, releaseNext, err := im.Resolve(ctx, urls[2], shas[2], nil)
	require.NoError(t, err)
	releaseNext()
	assert.NoFileExists(t, base, "released, the cache evicted it")
	pinned, err := os.ReadFile(h.RootDisk("vm1") + ".base")
	require.NoError(t, err)
	assert.Equal(t, bytes.Repeat([]byte{1}, size), pinned, "the root disk still has its base")

	// Resolved, then the create failed before any root disk was made: once
	// released, the image is evictable like any other.
	failed, release, err := im.Resolve(ctx, urls[3], shas[3], nil)
	require.NoError(t, err)
	release()
	assert.Zero(t, im.Pinned(shas[3]))
	_, release, err = im.Resolve(ctx, urls[0], shas[0], nil)
	require.NoError(t, err)
	release()
	assert.NoFileExists(t, failed, "a released image is evicted for the next")

	_, _, err = im.Resolve(ctx, urls[0], "not-a-digest", nil)
	require.Error(t, err)
	assert.Zero(t, im.Pinned("not-a-digest"), "a failed Resolve holds no pin")
}
