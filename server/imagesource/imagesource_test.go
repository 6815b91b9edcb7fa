package imagesource

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/sha512"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"github.com/ProtonMail/go-crypto/openpgp"
	"github.com/ProtonMail/go-crypto/openpgp/armor"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/wire/addrpolicy"
)

func TestParseSumsFindsTheImagesEntry(t *testing.T) {
	a64 := "A" + string(bytes.Repeat([]byte("b"), 63))
	c128 := string(bytes.Repeat([]byte("c"), 128))
	for name, tc := range map[string]struct {
		file, want string
		algo       Algorithm
	}{
		"GNU text mode":      {"0000000000000000000000000000000000000000000000000000000000000000  other.qcow2\n" + a64 + "  debian.qcow2\n", "a" + a64[1:], SHA256},
		"GNU binary mode":    {a64 + " *debian.qcow2\r\n", "a" + a64[1:], SHA256},
		"sha512 by length":   {c128 + "  debian.qcow2\n", c128, SHA512},
		"BSD tagged":         {"SHA512 (debian.qcow2) = " + c128 + "\n", c128, SHA512},
		"a path in the file": {c128 + "  ./images/debian.qcow2\n", c128, SHA512},
		"signed text around": {"-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA256\n\n" + c128 + "  debian.qcow2\n", c128, SHA512},
	} {
		t.Run(name, func(t *testing.T) {
			d, err := ParseSums([]byte(tc.file), "debian.qcow2")
			require.NoError(t, err)
			assert.Equal(t, tc.algo, d.Algorithm)
			assert.Equal(t, tc.want, d.Hex)
		})
	}
}

func TestParseSumsRefusesWhatItCannotTrust(t *testing.T) {
	c128 := string(bytes.Repeat([]byte("c"), 128))
	d128 := string(bytes.Repeat([]byte("d"), 128))
	for name, tc := range map[string]struct{ file, why string }{
		"not a SUMS file":     {"<html>hello</html>\n", "not a SUMS file"},
		"no entry":            {c128 + "  other.qcow2\n", `lists no file named "debian.qcow2"`},
		"two digests":         {c128 + "  debian.qcow2\n" + d128 + "  debian.qcow2\n", "more than once with different digests"},
		"an odd digest":       {"abcdef  debian.qcow2\n", "neither sha256 (64) nor sha512 (128)"},
		"a name that is near": {c128 + "  debian.qcow2.old\n", "lists no file"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ParseSums([]byte(tc.file), "debian.qcow2")
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.why)
		})
	}
}

func newKey(t *testing.T, name string) *openpgp.Entity {
	t.Helper()
	e, err := openpgp.NewEntity(name, "", name+"@example.org", nil)
	require.NoError(t, err)
	return e
}

// publicKeyring serializes keys' public parts, armored when asked.
func publicKeyring(t *testing.T, armored bool, keys ...*openpgp.Entity) []byte {
	t.Helper()
	var buf bytes.Buffer
	w := &buf
	if armored {
		aw, err := armor.Encode(&buf, openpgp.PublicKeyType, nil)
		require.NoError(t, err)
		for _, k := range keys {
			require.NoError(t, k.Serialize(aw))
		}
		require.NoError(t, aw.Close())
		return buf.Bytes()
	}
	for _, k := range keys {
		require.NoError(t, k.Serialize(w))
	}
	return buf.Bytes()
}

func sign(t *testing.T, k *openpgp.Entity, data []byte, armored bool) []byte {
	t.Helper()
	var buf bytes.Buffer
	if armored {
		require.NoError(t, openpgp.ArmoredDetachSign(&buf, k, bytes.NewReader(data), nil))
	} else {
		require.NoError(t, openpgp.DetachSign(&buf, k, bytes.NewReader(data), nil))
	}
	return buf.Bytes()
}

func TestSignatureByThePinnedKeyIsAcceptedAndByAnotherRefused(t *testing.T) {
	pinned, other := newKey(t, "Debian CD signing key"), newKey(t, "Mallory")
	sums := []byte("cccc  debian.qcow2\n")
	for _, armored := range []bool{false, true} {
		keys, err := ReadKeyring(publicKeyring(t, armored, pinned))
		require.NoError(t, err)

		signer, err := CheckSignature(keys, sums, sign(t, pinned, sums, armored))
		require.NoError(t, err, "armored=%v", armored)
		assert.Contains(t, signer, fmt.Sprintf("%X", pinned.PrimaryKey.Fingerprint))
		assert.Contains(t, signer, "Debian CD signing key")

		_, err = CheckSignature(keys, sums, sign(t, other, sums, armored))
		require.Error(t, err)
		assert.Contains(t, err.Error(), "not in the image's keyring")

		_, err = CheckSignature(keys, []byte("dddd  debian.qcow2\n"), sign(t, pinned, sums, armored))
		require.Error(t, err, "a signature over other bytes does not verify")
		assert.Contains(t, err.Error(), "does not verify")
	}
}

func TestKeyringRefusesPrivateKeysAndNonsense(t *testing.T) {
	k := newKey(t, "k")
	var priv bytes.Buffer
	require.NoError(t, k.SerializePrivate(&priv, nil))
	_, err := ReadKeyring(priv.Bytes())
	require.Error(t, err)
	assert.Contains(t, err.Error(), "private key")
	_, err = ReadKeyring([]byte("not a key"))
	require.Error(t, err)
	assert.Error(t, CheckKeyring(nil))
}

func hexOf(h interface{ Sum([]byte) []byte }) string { return hex.EncodeToString(h.Sum(nil)) }

// loopback admits the tests' httptest servers, as an operator's
// --image-allow would.
var loopback = addrpolicy.Policy{Allow: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}}

func TestResolveChecksTheBytesAgainstASignedSHA512SUMS(t *testing.T) {
	image := bytes.Repeat([]byte("eitri image "), 5000)
	s512 := sha512.Sum512(image)
	s256 := sha256.Sum256(image)
	key := newKey(t, "Distribution")
	sums := []byte(hex.EncodeToString(s512[:]) + "  guest.qcow2\n")
	files := map[string][]byte{
		"/guest.qcow2":         image,
		"/SHA512SUMS":          sums,
		"/SHA512SUMS.sign":     sign(t, key, sums, false),
		"/bad/SHA512SUMS":      []byte(hex.EncodeToString(bytes.Repeat([]byte{1}, 64)) + "  guest.qcow2\n"),
		"/SHA256SUMS":          []byte(hex.EncodeToString(s256[:]) + "  guest.qcow2\n"),
		"/redirect/SHA512SUMS": nil,
	}
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/redirect/SHA512SUMS" {
			http.Redirect(w, r, "/SHA512SUMS", http.StatusFound)
			return
		}
		b, ok := files[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write(b)
	}))
	defer ts.Close()
	f := Fetcher{Policy: loopback}
	ctx := context.Background()
	now := time.Unix(1000, 0)

	got, err := f.Resolve(ctx, Source{URL: ts.URL + "/guest.qcow2", SumsURL: ts.URL + "/redirect/SHA512SUMS",
		SignatureURL: ts.URL + "/SHA512SUMS.sign", Keyring: publicKeyring(t, true, key)}, now)
	require.NoError(t, err)
	assert.Equal(t, hex.EncodeToString(s256[:]), got.SHA256, "hosts get the sha256 of the bytes the SUMS file vouched for")
	assert.Equal(t, hex.EncodeToString(s512[:]), got.SHA512)
	assert.Equal(t, int64(len(image)), got.Size)
	assert.Contains(t, got.Signer, "Distribution")
	assert.Equal(t, now, got.VerifiedAt)

	got, err = f.Resolve(ctx, Source{URL: ts.URL + "/guest.qcow2", SumsURL: ts.URL + "/SHA256SUMS"}, now)
	require.NoError(t, err)
	assert.Empty(t, got.SHA512)
	assert.Empty(t, got.Signer)

	_, err = f.Resolve(ctx, Source{URL: ts.URL + "/guest.qcow2", SumsURL: ts.URL + "/bad/SHA512SUMS"}, now)
	assertField(t, err, "url", "but the SUMS file lists")

	_, err = f.Resolve(ctx, Source{URL: ts.URL + "/guest.qcow2", SumsURL: ts.URL + "/SHA512SUMS",
		SignatureURL: ts.URL + "/SHA512SUMS.sign", Keyring: publicKeyring(t, false, newKey(t, "someone else"))}, now)
	assertField(t, err, "sums_signature_url", "not in the image's keyring")

	_, err = f.Resolve(ctx, Source{URL: ts.URL + "/guest.qcow2", SumsURL: ts.URL + "/missing"}, now)
	assertField(t, err, "sums_url", "404")

	_, err = Fetcher{}.Resolve(ctx, Source{URL: ts.URL + "/guest.qcow2", SumsURL: ts.URL + "/SHA512SUMS"}, now)
	assertField(t, err, "sums_url", "loopback")
}

func TestSmallFetchesAreBounded(t *testing.T) {
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/chunked" {
			w.(http.Flusher).Flush() // no Content-Length: the reader must count
		}
		_, _ = w.Write(bytes.Repeat([]byte("x"), 3000))
	}))
	defer ts.Close()
	f := Fetcher{Policy: loopback}
	for _, p := range []string{"/sized", "/chunked"} {
		_, err := f.Small(context.Background(), "sums_url", ts.URL+p, 1000)
		assertField(t, err, "sums_url", "1000")
	}
	b, err := f.Small(context.Background(), "sums_url", ts.URL+"/sized", 3000)
	require.NoError(t, err)
	assert.Len(t, b, 3000)
}

func assertField(t *testing.T, err error, field, why string) {
	t.Helper()
	require.Error(t, err)
	fe, ok := err.(*FieldError)
	require.True(t, ok, "a field error: %v", err)
	assert.Equal(t, field, fe.Field, "%v", err)
	assert.Contains(t, err.Error(), why)
}
