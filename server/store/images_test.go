package store

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestImageCatalogue(t *testing.T) { eachEngine(t, testImageCatalogue) }

func testImageCatalogue(t *testing.T, e engine) {
	ctx := context.Background()
	s, _ := e.open(t)
	at := time.Unix(200, 0).UTC()
	img := Image{Name: "debian-12", OS: "debian", OSVersion: "12", Architecture: "amd64", LoginUser: "debian",
		MinDiskGB: 2, MinMemMB: 512, Description: "Debian 12 cloud", Readiness: "cloud-init",
		URL: "https://example.org/d.qcow2", SumsURL: "https://example.org/SHA512SUMS", SumsFileName: "d.qcow2",
		Keyring: []byte{0x99, 0, 1, 0xff}, CreatedAt: at}
	sha := func(c byte) string {
		b := make([]byte, 64)
		for i := range b {
			b[i] = c
		}
		return string(b)
	}
	first := ImageVersion{URL: img.URL, SHA256: sha('a'), SHA512: "ff", Size: 10, SumsURL: img.SumsURL, Signer: "ABCD", VerifiedAt: &at, AddedBy: "u1"}
	require.NoError(t, s.CreateImage(ctx, img, first))
	assert.ErrorIs(t, s.CreateImage(ctx, img, first), ErrConflict, "one entry per name")

	got, err := s.Image(ctx, "debian-12")
	require.NoError(t, err)
	assert.Equal(t, int64(1), got.Current)
	assert.Equal(t, img.Keyring, got.Keyring, "the pinned keyring comes back byte for byte")
	assert.Equal(t, "cloud-init", got.Readiness)
	cur, ok := got.CurrentVersion()
	require.True(t, ok)
	assert.Equal(t, sha('a'), cur.SHA256)
	require.NotNil(t, cur.VerifiedAt)
	assert.True(t, at.Equal(*cur.VerifiedAt))

	// The same digest again moves nothing, but says it was verified again.
	later := at.Add(time.Hour)
	same := first
	same.VerifiedAt = &later
	got, changed, err := s.AdvanceImage(ctx, "debian-12", same, 3)
	require.NoError(t, err)
	assert.False(t, changed)
	assert.Len(t, got.Versions, 1)
	cur, _ = got.CurrentVersion()
	assert.True(t, later.Equal(*cur.VerifiedAt), "the re-verification is recorded")

	// New digests number up and only the newest three are kept.
	for i, c := range []byte{'b', 'c', 'd', 'e'} {
		v := first
		v.SHA256 = sha(c)
		got, changed, err = s.AdvanceImage(ctx, "debian-12", v, 3)
		require.NoError(t, err)
		assert.True(t, changed)
		assert.Equal(t, int64(i+2), got.Current)
	}
	require.Len(t, got.Versions, 3)
	assert.Equal(t, []int64{5, 4, 3}, []int64{got.Versions[0].Version, got.Versions[1].Version, got.Versions[2].Version}, "newest first")
	cur, _ = got.CurrentVersion()
	assert.Equal(t, sha('e'), cur.SHA256)

	list, err := s.ListImages(ctx)
	require.NoError(t, err)
	require.Len(t, list, 1)
	assert.Len(t, list[0].Versions, 3)

	require.NoError(t, s.AddImagePulls(ctx, "debian-12", []string{"h2", "h1"}))
	require.NoError(t, s.AddImagePulls(ctx, "debian-12", []string{"h1"}), "a second pull to a host changes nothing")
	hosts, err := s.ImagePullHosts(ctx, "debian-12")
	require.NoError(t, err)
	assert.Equal(t, []string{"h1", "h2"}, hosts)
	names, err := s.ImagePullsForHost(ctx, "h1")
	require.NoError(t, err)
	assert.Equal(t, []string{"debian-12"}, names)
	assert.ErrorIs(t, s.AddImagePulls(ctx, "nope", []string{"h1"}), ErrNotFound)

	require.NoError(t, s.DeleteImage(ctx, "debian-12"))
	names, err = s.ImagePullsForHost(ctx, "h1")
	require.NoError(t, err)
	assert.Empty(t, names, "removing the image ends its pulls")
	_, err = s.Image(ctx, "debian-12")
	assert.ErrorIs(t, err, ErrNotFound)
	assert.ErrorIs(t, s.DeleteImage(ctx, "debian-12"), ErrNotFound)
	_, _, err = s.AdvanceImage(ctx, "debian-12", first, 3)
	assert.ErrorIs(t, err, ErrNotFound)

	// A name added again starts over, with none of the old versions.
	require.NoError(t, s.CreateImage(ctx, img, first))
	got, err = s.Image(ctx, "debian-12")
	require.NoError(t, err)
	assert.Len(t, got.Versions, 1)
}

func TestVMKeepsItsImage(t *testing.T) { eachEngine(t, testVMKeepsItsImage) }

func testVMKeepsItsImage(t *testing.T, e engine) {
	ctx := context.Background()
	s, _ := e.open(t)
	u := User{ID: "u1", Name: "alice"}
	require.NoError(t, s.CreateUser(ctx, u))
	vm := VM{ID: "vm-1", OwnerID: "u1", Name: "web-1", ImageURL: "https://example.org/d.qcow2", PowerState: "running",
		ImageName: "debian-12", ImageVersion: 4, Readiness: "address"}
	mustCreateVM(t, s, vm)
	got, err := s.GetVM(ctx, "vm-1")
	require.NoError(t, err)
	assert.Equal(t, "debian-12", got.ImageName)
	assert.Equal(t, int64(4), got.ImageVersion)
	assert.Equal(t, "address", got.Readiness)
}
