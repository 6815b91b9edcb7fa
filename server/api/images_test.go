package api_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/hex"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/ProtonMail/go-crypto/openpgp"
	"github.com/ProtonMail/go-crypto/openpgp/armor"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/addrpolicy"
)

// imageEnv is a control plane whose catalogue may fetch from loopback, as
// an operator's --image-allow would let it reach a mirror: the tests'
// distribution is an httptest server.
func imageEnv(t *testing.T) *env {
	t.Helper()
	dir := t.TempDir()
	s, err := server.New(context.Background(), server.Config{DataDir: dir, Plaintext: true, DeleteGrace: time.Hour,
		ImagePolicy: addrpolicy.Policy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}})
	require.NoError(t, err)
	ts := httptest.NewUnstartedServer(s.Handler())
	ts.EnableHTTP2 = true
	ts.StartTLS()
	t.Cleanup(func() { ts.Close(); s.Close() })
	return &env{t: t, srv: s, url: ts.URL, http: ts.Client(), admin: s.AdminToken, dir: dir}
}

func (e *env) images(tok string) eitriv1connect.ImageServiceClient {
	return eitriv1connect.NewImageServiceClient(e.http, e.url, bearer(tok))
}

// distribution serves an image with a SHA512SUMS (signed with key) and a
// SHA256SUMS beside it, as Debian and Ubuntu publish theirs; setImage
// publishes a new build under the same name.
type distribution struct {
	t   *testing.T
	key *openpgp.Entity
	ts  *httptest.Server

	mu    sync.Mutex
	files map[string][]byte
}

func newDistribution(t *testing.T, key *openpgp.Entity, image []byte) *distribution {
	d := &distribution{t: t, key: key, files: map[string][]byte{}}
	d.setImage(image)
	d.ts = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d.mu.Lock()
		b, ok := d.files[r.URL.Path]
		d.mu.Unlock()
		if !ok {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write(b)
	}))
	t.Cleanup(d.ts.Close)
	return d
}

func (d *distribution) setImage(image []byte) {
	s512, s256 := sha512.Sum512(image), sha256.Sum256(image)
	sums512 := []byte(hex.EncodeToString(bytes.Repeat([]byte{7}, 64)) + "  other.qcow2\n" + hex.EncodeToString(s512[:]) + "  guest.qcow2\n")
	var sig bytes.Buffer
	require.NoError(d.t, openpgp.DetachSign(&sig, d.key, bytes.NewReader(sums512), nil))
	d.mu.Lock()
	defer d.mu.Unlock()
	d.files["/guest.qcow2"] = image
	d.files["/SHA512SUMS"] = sums512
	d.files["/SHA512SUMS.sign"] = sig.Bytes()
	d.files["/SHA256SUMS"] = []byte(hex.EncodeToString(s256[:]) + " *guest.qcow2\n")
	d.files["/wrong/SHA512SUMS"] = []byte(hex.EncodeToString(bytes.Repeat([]byte{1}, 64)) + "  guest.qcow2\n")
}

func (d *distribution) url(p string) string { return d.ts.URL + p }

func pgpKey(t *testing.T, name string) *openpgp.Entity {
	t.Helper()
	k, err := openpgp.NewEntity(name, "", "cd@example.org", nil)
	require.NoError(t, err)
	return k
}

func armoredPublic(t *testing.T, k *openpgp.Entity) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := armor.Encode(&buf, openpgp.PublicKeyType, nil)
	require.NoError(t, err)
	require.NoError(t, k.Serialize(w))
	require.NoError(t, w.Close())
	return buf.Bytes()
}

func hexSum256(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
func hexSum512(b []byte) string { s := sha512.Sum512(b); return hex.EncodeToString(s[:]) }

func TestAddResolvesTheDigestFromASignedSHA512SUMSAndRefreshFollowsIt(t *testing.T) {
	e := imageEnv(t)
	ctx := context.Background()
	key := pgpKey(t, "Debian CD signing key")
	v1 := bytes.Repeat([]byte("first build "), 4000)
	d := newDistribution(t, key, v1)

	before := time.Now()
	add, err := e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{
		Name: "debian-12", Url: d.url("/guest.qcow2"), SumsUrl: d.url("/SHA512SUMS"), SumsSignatureUrl: d.url("/SHA512SUMS.sign"),
		Keyring:    armoredPublic(t, key),
		Properties: &eitriv1.ImageProperties{Os: "debian", OsVersion: "12", Architecture: "amd64", LoginUser: "debian", Description: "Debian 12"},
	}))
	require.NoError(t, err)
	img := add.Msg.Image
	require.NotNil(t, img.Current)
	assert.Equal(t, int64(1), img.Current.Version)
	assert.Equal(t, hexSum256(v1), img.Current.Sha256, "hosts are told the sha256 of the bytes the signed SHA512SUMS vouched for")
	assert.Equal(t, hexSum512(v1), img.Current.Sha512)
	assert.Equal(t, int64(len(v1)), img.Current.Size)
	assert.Contains(t, img.Current.Provenance.Signer, "Debian CD signing key")
	assert.Equal(t, d.url("/SHA512SUMS"), img.Current.Provenance.SumsUrl)
	assert.False(t, img.Current.Provenance.VerifiedAt.AsTime().Before(before.Truncate(time.Second)))
	assert.True(t, img.KeyringPinned)
	assert.Equal(t, "Debian 12", img.Properties.Description)

	// Nothing new: the name stays where it is.
	ref, err := e.images(e.admin).RefreshImage(ctx, connect.NewRequest(&eitriv1.RefreshImageRequest{Name: "debian-12"}))
	require.NoError(t, err)
	assert.False(t, ref.Msg.Changed)
	assert.Equal(t, int64(1), ref.Msg.Image.Current.Version)

	// A new build: the name moves and the old version is kept.
	v2 := bytes.Repeat([]byte("second build "), 4000)
	d.setImage(v2)
	ref, err = e.images(e.admin).RefreshImage(ctx, connect.NewRequest(&eitriv1.RefreshImageRequest{Name: "debian-12"}))
	require.NoError(t, err)
	assert.True(t, ref.Msg.Changed)
	assert.Equal(t, int64(2), ref.Msg.Image.Current.Version)
	assert.Equal(t, hexSum256(v2), ref.Msg.Image.Current.Sha256)
	require.Len(t, ref.Msg.Image.Versions, 2)
	assert.Equal(t, hexSum256(v1), ref.Msg.Image.Versions[1].Sha256)

	// A SHA256SUMS, unsigned.
	add, err = e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{
		Name: "ubuntu", Url: d.url("/guest.qcow2"), SumsUrl: d.url("/SHA256SUMS")}))
	require.NoError(t, err)
	assert.Equal(t, hexSum256(v2), add.Msg.Image.Current.Sha256)
	assert.Empty(t, add.Msg.Image.Current.Sha512)
	assert.Empty(t, add.Msg.Image.Current.Provenance.Signer)
}

func TestABadSourceFailsTheAddWithTheReasonAndLeavesNothing(t *testing.T) {
	e := imageEnv(t)
	ctx := context.Background()
	key := pgpKey(t, "Debian CD signing key")
	d := newDistribution(t, key, bytes.Repeat([]byte("build "), 1000))
	for name, tc := range map[string]struct {
		req         *eitriv1.AddImageRequest
		field, says string
	}{
		"a SUMS entry that does not match the bytes": {&eitriv1.AddImageRequest{Url: d.url("/guest.qcow2"), SumsUrl: d.url("/wrong/SHA512SUMS")},
			"url: ", "but the SUMS file lists"},
		"a signature by a key not pinned": {&eitriv1.AddImageRequest{Url: d.url("/guest.qcow2"), SumsUrl: d.url("/SHA512SUMS"),
			SumsSignatureUrl: d.url("/SHA512SUMS.sign"), Keyring: armoredPublic(t, pgpKey(t, "Mallory"))},
			"sums_signature_url: ", "not in the image's keyring"},
		"a signature over another file": {&eitriv1.AddImageRequest{Url: d.url("/guest.qcow2"), SumsUrl: d.url("/SHA256SUMS"),
			SumsSignatureUrl: d.url("/SHA512SUMS.sign"), Keyring: armoredPublic(t, key)},
			"sums_signature_url: ", "does not verify"},
		"a SUMS file that is not there": {&eitriv1.AddImageRequest{Url: d.url("/guest.qcow2"), SumsUrl: d.url("/nope")},
			"sums_url: ", "404"},
		"a SUMS file without the image": {&eitriv1.AddImageRequest{Url: d.url("/guest.qcow2"), SumsUrl: d.url("/SHA512SUMS"), SumsFileName: "x.img"},
			"sums_url: ", `lists no file named "x.img"`},
	} {
		t.Run(name, func(t *testing.T) {
			tc.req.Name = "bad"
			_, err := e.images(e.admin).AddImage(ctx, connect.NewRequest(tc.req))
			require.Error(t, err)
			assert.Equal(t, connect.CodeInvalidArgument, code(err), "%v", err)
			assert.Contains(t, err.Error(), tc.field)
			assert.Contains(t, err.Error(), tc.says)
			_, err = e.images(e.admin).GetImage(ctx, connect.NewRequest(&eitriv1.GetImageRequest{Name: "bad"}))
			assert.Equal(t, connect.CodeNotFound, code(err), "nothing half-added remains")
		})
	}

	// Without an operator's allowance, the control plane does not fetch
	// from its own loopback.
	strict := newEnv(t)
	_, err := strict.images(strict.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{
		Name: "bad", Url: d.url("/guest.qcow2"), SumsUrl: d.url("/SHA512SUMS")}))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "sums_url: address 127.0.0.1 is not allowed")
}

func TestBadImageInputNamesTheField(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	ok := func() *eitriv1.AddImageRequest {
		return &eitriv1.AddImageRequest{Name: "debian-12", Url: "https://images.test/d.qcow2", Sha256: sha}
	}
	for field, mut := range map[string]func(*eitriv1.AddImageRequest){
		"name":               func(r *eitriv1.AddImageRequest) { r.Name = "Debian 12" },
		"url":                func(r *eitriv1.AddImageRequest) { r.Url = "file:///etc/passwd" },
		"sha256":             func(r *eitriv1.AddImageRequest) { r.Sha256 = "abc" },
		"sums_url":           func(r *eitriv1.AddImageRequest) { r.Sha256, r.SumsUrl = "", "ftp://x/SUMS" },
		"sums_signature_url": func(r *eitriv1.AddImageRequest) { r.SumsSignatureUrl = "https://images.test/SUMS.sign" },
		"keyring": func(r *eitriv1.AddImageRequest) {
			r.Sha256, r.SumsUrl, r.SumsSignatureUrl = "", "https://x/S", "https://x/S.sign"
		},
		"properties.min_disk_gb": func(r *eitriv1.AddImageRequest) { r.Properties = &eitriv1.ImageProperties{MinDiskGb: -1} },
		"properties.description": func(r *eitriv1.AddImageRequest) {
			r.Properties = &eitriv1.ImageProperties{Description: string(make([]byte, 2000))}
		},
		"properties.readiness": func(r *eitriv1.AddImageRequest) { r.Properties = &eitriv1.ImageProperties{Readiness: 99} },
		"properties.login_user": func(r *eitriv1.AddImageRequest) {
			r.Properties = &eitriv1.ImageProperties{LoginUser: string(make([]byte, 64))}
		},
		"sha256: give either": func(r *eitriv1.AddImageRequest) { r.SumsUrl = "https://x/S" },
		"keyring: not an OpenPGP": func(r *eitriv1.AddImageRequest) {
			r.Sha256, r.SumsUrl, r.SumsSignatureUrl, r.Keyring = "", "https://x/S", "https://x/S.sign", []byte("junk")
		},
	} {
		r := ok()
		mut(r)
		_, err := e.images(e.admin).AddImage(ctx, connect.NewRequest(r))
		assert.Equal(t, connect.CodeInvalidArgument, code(err), "%s: %v", field, err)
		assert.ErrorContains(t, err, field)
	}
	list, err := e.images(e.admin).ListImages(ctx, connect.NewRequest(&eitriv1.ListImagesRequest{}))
	require.NoError(t, err)
	assert.Empty(t, list.Msg.Images, "nothing was added")
}

func TestOnlyAdminsChangeTheCatalogueAndEveryoneSeesTheSameOne(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	alice, bob := e.user("alice"), e.user("bob")
	_, err := e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{Name: "debian-12", Url: "https://images.test/d.qcow2", Sha256: sha}))
	require.NoError(t, err)

	_, err = e.images(alice).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{Name: "mine", Url: "https://images.test/m.qcow2", Sha256: sha}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))
	_, err = e.images(alice).DeleteImage(ctx, connect.NewRequest(&eitriv1.DeleteImageRequest{Name: "debian-12"}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))
	_, err = e.images(alice).RefreshImage(ctx, connect.NewRequest(&eitriv1.RefreshImageRequest{Name: "debian-12"}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))

	la, err := e.images(alice).ListImages(ctx, connect.NewRequest(&eitriv1.ListImagesRequest{}))
	require.NoError(t, err)
	lb, err := e.images(bob).ListImages(ctx, connect.NewRequest(&eitriv1.ListImagesRequest{}))
	require.NoError(t, err)
	require.Len(t, la.Msg.Images, 1, "alice's refused add left nothing")
	assert.Equal(t, "debian-12", la.Msg.Images[0].Name)
	assert.Equal(t, la.Msg.Images[0].Current.Sha256, lb.Msg.Images[0].Current.Sha256, "one catalogue for everyone")
	got, err := e.images(bob).GetImage(ctx, connect.NewRequest(&eitriv1.GetImageRequest{Name: "debian-12"}))
	require.NoError(t, err)
	assert.Equal(t, sha, got.Msg.Image.Current.Sha256)

	_, err = e.images(e.admin).RefreshImage(ctx, connect.NewRequest(&eitriv1.RefreshImageRequest{Name: "debian-12"}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err), "a fixed sha256 has no source to refresh from")
	_, err = e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{Name: "debian-12", Url: "https://images.test/x.qcow2", Sha256: sha}))
	assert.Equal(t, connect.CodeAlreadyExists, code(err))

	_, err = e.images("").ListImages(ctx, connect.NewRequest(&eitriv1.ListImagesRequest{}))
	assert.Equal(t, connect.CodeUnauthenticated, code(err))

	_, err = e.images(e.admin).DeleteImage(ctx, connect.NewRequest(&eitriv1.DeleteImageRequest{Name: "debian-12"}))
	require.NoError(t, err)
	_, err = e.images(alice).GetImage(ctx, connect.NewRequest(&eitriv1.GetImageRequest{Name: "debian-12"}))
	assert.Equal(t, connect.CodeNotFound, code(err))
}

func TestCreateByNameTakesTheCurrentVersionItsMinimumsAndItsReadiness(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice := e.user("alice")
	_, err := e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{
		Name: "appliance", Url: "https://images.test/a.raw", Sha256: sha,
		Properties: &eitriv1.ImageProperties{MinDiskGb: 3, MinMemMb: 512, Readiness: eitriv1.ImageReadiness_IMAGE_READINESS_ADDRESS},
	}))
	require.NoError(t, err)

	byName := func(disk, mem int64) *eitriv1.CreateVMRequest {
		return &eitriv1.CreateVMRequest{Name: "web-1", Image: "appliance", Vcpus: 1, MemMb: mem, DiskGb: disk}
	}
	_, err = e.vms(alice).CreateVM(ctx, connect.NewRequest(byName(2, 512)))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "disk_gb: image appliance needs at least 3 GiB")
	_, err = e.vms(alice).CreateVM(ctx, connect.NewRequest(byName(3, 256)))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "mem_mb: image appliance needs at least 512 MiB")
	both := byName(3, 512)
	both.ImageUrl = "https://images.test/b.raw"
	_, err = e.vms(alice).CreateVM(ctx, connect.NewRequest(both))
	assert.ErrorContains(t, err, "image_url: give either image")
	unknown := byName(3, 512)
	unknown.Image = "nope"
	_, err = e.vms(alice).CreateVM(ctx, connect.NewRequest(unknown))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, `image: no image named "nope"`)

	vm, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(byName(3, 512)))
	require.NoError(t, err)
	assert.Equal(t, "appliance", vm.Msg.Vm.ImageName)
	assert.Equal(t, int64(1), vm.Msg.Vm.ImageVersion)
	assert.Equal(t, "https://images.test/a.raw", vm.Msg.Vm.ImageUrl)
	assert.Equal(t, sha, vm.Msg.Vm.ImageSha256, "the VM records the digest it was made from")

	var desired *eitriv1.VMDesired
	require.Eventually(t, func() bool {
		for _, d := range a.next(t).GetVms() {
			if d.GetVmId() == vm.Msg.Vm.Id {
				desired = d
				return true
			}
		}
		return false
	}, 5*time.Second, time.Millisecond)
	assert.Equal(t, eitriv1.ImageReadiness_IMAGE_READINESS_ADDRESS, desired.GetReadiness(), "the host is told how to judge the guest ready")
	assert.Equal(t, sha, desired.GetImageSha256())

	// Removing the name does not touch the VM made from it.
	_, err = e.images(e.admin).DeleteImage(ctx, connect.NewRequest(&eitriv1.DeleteImageRequest{Name: "appliance"}))
	require.NoError(t, err)
	got, err := e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: vm.Msg.Vm.Id}))
	require.NoError(t, err)
	assert.Equal(t, "appliance", got.Msg.Vm.ImageName)
	assert.Equal(t, sha, got.Msg.Vm.ImageSha256)
}

func TestPullSendsTheImageToItsHostsAndTheCatalogueSaysWhoHoldsIt(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice := e.user("alice")
	_, err := e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{Name: "debian-12", Url: "https://images.test/d.qcow2", Sha256: sha}))
	require.NoError(t, err)

	_, err = e.images(alice).PullImage(ctx, connect.NewRequest(&eitriv1.PullImageRequest{Name: "debian-12", All: true}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))
	_, err = e.images(e.admin).PullImage(ctx, connect.NewRequest(&eitriv1.PullImageRequest{Name: "debian-12", HostIds: []string{"h-nope"}}))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "host_ids")
	_, err = e.images(e.admin).PullImage(ctx, connect.NewRequest(&eitriv1.PullImageRequest{Name: "debian-12"}))
	assert.ErrorContains(t, err, "host_ids: name the hosts, or set all")
	_, err = e.images(e.admin).PullImage(ctx, connect.NewRequest(&eitriv1.PullImageRequest{Name: "nope", All: true}))
	assert.Equal(t, connect.CodeNotFound, code(err))

	r, err := e.images(e.admin).PullImage(ctx, connect.NewRequest(&eitriv1.PullImageRequest{Name: "debian-12", HostIds: []string{h}}))
	require.NoError(t, err)
	require.Len(t, r.Msg.Image.Hosts, 1)
	assert.Equal(t, "h1", r.Msg.Image.Hosts[0].HostName)
	assert.Equal(t, "unknown", r.Msg.Image.Hosts[0].State, "nothing reported yet")

	var wanted []*eitriv1.ImageWanted
	require.Eventually(t, func() bool { wanted = a.next(t).GetImages(); return len(wanted) == 1 }, 5*time.Second, time.Millisecond)
	assert.Equal(t, "https://images.test/d.qcow2", wanted[0].GetUrl())
	assert.Equal(t, sha, wanted[0].GetSha256())

	hostState := func() *eitriv1.ImageOnHost {
		g, err := e.images(alice).GetImage(ctx, connect.NewRequest(&eitriv1.GetImageRequest{Name: "debian-12"}))
		require.NoError(t, err)
		require.Len(t, g.Msg.Image.Hosts, 1)
		return g.Msg.Image.Hosts[0]
	}
	total := uint64(4 << 20)
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Images: []*eitriv1.ImageHeld{{Sha256: sha, StatusDetail: "downloading image 1.0/4.0 MiB",
		Progress: &eitriv1.Progress{Step: "download", DoneBytes: 1 << 20, TotalBytes: &total}}}})
	require.Eventually(t, func() bool { return hostState().State == "pulling" }, 5*time.Second, time.Millisecond)
	assert.Equal(t, "downloading image 1.0/4.0 MiB", hostState().StatusDetail)
	assert.Equal(t, uint64(1<<20), hostState().Progress.GetDoneBytes())

	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Images: []*eitriv1.ImageHeld{{Sha256: sha, Held: true}}})
	require.Eventually(t, func() bool { return hostState().State == "held" }, 5*time.Second, time.Millisecond)

	// Removed from the catalogue: the host is told to let it go.
	_, err = e.images(e.admin).DeleteImage(ctx, connect.NewRequest(&eitriv1.DeleteImageRequest{Name: "debian-12"}))
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(a.next(t).GetImages()) == 0 }, 5*time.Second, time.Millisecond)
}

// TestACatalogueWatcherSeesAddsPullsAsTheHostNarratesThemAndRemovals: a
// user's WatchImages stream gets the catalogue, then each change as it
// happens, pushed; bad requests name their field.
func TestACatalogueWatcherSeesAddsPullsAsTheHostNarratesThemAndRemovals(t *testing.T) {
	e := newEnv(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice := e.user("alice")

	_, err := e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{Name: "alpine", Url: "https://images.test/a.raw", Sha256: sha}))
	require.NoError(t, err)
	w, err := e.images(alice).WatchImages(ctx, connect.NewRequest(&eitriv1.WatchImagesRequest{}))
	require.NoError(t, err)
	defer w.Close()
	require.True(t, w.Receive(), "the catalogue first: %v", w.Err())
	require.Len(t, w.Msg().GetSnapshot().GetImages(), 1)
	assert.Equal(t, "alpine", w.Msg().GetSnapshot().GetImages()[0].GetName())

	// next reads the stream until an event about name satisfies ok.
	next := func(what string, ok func(*eitriv1.WatchImagesResponse) bool) {
		t.Helper()
		for w.Receive() {
			if ok(w.Msg()) {
				return
			}
		}
		t.Fatalf("the stream ended before %s: %v", what, w.Err())
	}
	state := func(state, detail string) func(*eitriv1.WatchImagesResponse) bool {
		return func(m *eitriv1.WatchImagesResponse) bool {
			hs := m.GetChanged().GetHosts()
			return m.GetChanged().GetName() == "debian-12" && len(hs) == 1 && hs[0].GetState() == state && hs[0].GetStatusDetail() == detail
		}
	}

	_, err = e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{Name: "debian-12", Url: "https://images.test/d.raw", Sha256: sha}))
	require.NoError(t, err)
	next("the add", func(m *eitriv1.WatchImagesResponse) bool { return m.GetChanged().GetName() == "debian-12" })
	_, err = e.images(e.admin).PullImage(ctx, connect.NewRequest(&eitriv1.PullImageRequest{Name: "debian-12", HostIds: []string{h}}))
	require.NoError(t, err)
	next("the pull", state("unknown", ""))
	for _, step := range []string{"downloading image 1.0/4.0 MiB", "downloading image 3.0/4.0 MiB"} {
		a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Images: []*eitriv1.ImageHeld{{Sha256: sha, StatusDetail: step}}})
		next(step, state("pulling", step))
	}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Images: []*eitriv1.ImageHeld{{Sha256: sha, Held: true}}})
	next("held", state("held", ""))
	_, err = e.images(e.admin).DeleteImage(ctx, connect.NewRequest(&eitriv1.DeleteImageRequest{Name: "debian-12"}))
	require.NoError(t, err)
	next("the removal", func(m *eitriv1.WatchImagesResponse) bool { return m.GetRemovedName() == "debian-12" })

	// One image by name: its snapshot alone; a name the catalogue lacks is
	// NotFound, a malformed one names the field, no credential is refused.
	one, err := e.images(alice).WatchImages(ctx, connect.NewRequest(&eitriv1.WatchImagesRequest{Name: "alpine"}))
	require.NoError(t, err)
	require.True(t, one.Receive())
	assert.Len(t, one.Msg().GetSnapshot().GetImages(), 1)
	one.Close()
	for _, c := range []struct {
		name, token string
		code        connect.Code
		says        string
	}{
		{"nope", alice, connect.CodeNotFound, "nope"},
		{strings.Repeat("x", 200), alice, connect.CodeInvalidArgument, "name"},
		{"alpine", "", connect.CodeUnauthenticated, ""},
	} {
		s, err := e.images(c.token).WatchImages(ctx, connect.NewRequest(&eitriv1.WatchImagesRequest{Name: c.name}))
		if err == nil {
			assert.False(t, s.Receive())
			err = s.Err()
			s.Close()
		}
		assert.Equal(t, c.code, connect.CodeOf(err), c.name)
		assert.ErrorContains(t, err, c.says)
	}
}
