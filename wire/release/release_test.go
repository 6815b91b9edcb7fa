package release_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/wire/release"
)

func writeBuild(t *testing.T, content []byte) (string, release.Build) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "eitri")
	require.NoError(t, os.WriteFile(path, content, 0o755))
	d, err := release.SumFile(path)
	require.NoError(t, err)
	return path, release.Build{Version: "v1.4", OS: "linux", Arch: "amd64", SHA256: d.SHA256, Size: d.Size}
}

func TestASignedBuildVerifiesWithItsKey(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	path, b := writeBuild(t, bytes.Repeat([]byte("eitri"), 1000))
	sig, err := release.Sign(priv, b)
	require.NoError(t, err)

	// Through the files an operator carries around.
	parsed, err := release.ParseSignature(sig.Marshal())
	require.NoError(t, err)
	key, err := release.ParsePublicKey(pub.String() + "\n")
	require.NoError(t, err)
	assert.NoError(t, key.VerifyFile(parsed, path))
	assert.Equal(t, pub.ID(), parsed.KeyID)
}

func TestOneByteChangedIsRefused(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	content := bytes.Repeat([]byte("eitri"), 1000)
	path, b := writeBuild(t, content)
	sig, err := release.Sign(priv, b)
	require.NoError(t, err)

	content[len(content)/2] ^= 1
	require.NoError(t, os.WriteFile(path, content, 0o755))
	err = pub.VerifyFile(sig, path)
	require.ErrorIs(t, err, release.ErrUntrusted)
	assert.Contains(t, err.Error(), "sha256")
}

func TestAnotherKeysSignatureIsRefused(t *testing.T) {
	pub, _, err := release.GenerateKey()
	require.NoError(t, err)
	_, other, err := release.GenerateKey()
	require.NoError(t, err)
	path, b := writeBuild(t, []byte("a build"))
	sig, err := release.Sign(other, b)
	require.NoError(t, err)

	err = pub.VerifyFile(sig, path)
	require.ErrorIs(t, err, release.ErrUntrusted)
	assert.Contains(t, err.Error(), other.Public().ID(), "the refusal names the foreign signer")

	// A forger who relabels the signature with the trusted key's id gets no
	// further: the bytes still are not that key's.
	sig.KeyID = pub.ID()
	assert.ErrorIs(t, pub.VerifyFile(sig, path), release.ErrUntrusted)
}

func TestAClaimChangedAfterSigningIsRefused(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	_, b := writeBuild(t, []byte("a build"))
	sig, err := release.Sign(priv, b)
	require.NoError(t, err)
	for name, edit := range map[string]func(*release.Signature){
		"version": func(s *release.Signature) { s.Version = "v9.9" },
		"os":      func(s *release.Signature) { s.OS = "darwin" },
		"arch":    func(s *release.Signature) { s.Arch = "arm64" },
		"size":    func(s *release.Signature) { s.Size++ },
	} {
		t.Run(name, func(t *testing.T) {
			s := sig
			edit(&s)
			assert.ErrorIs(t, pub.Verify(s), release.ErrUntrusted)
		})
	}
}

func TestKeysSurviveTheirFiles(t *testing.T) {
	pub, priv, err := release.GenerateKey()
	require.NoError(t, err)
	back, err := release.ParsePrivateKey(release.MarshalPrivateKey(priv))
	require.NoError(t, err)
	assert.True(t, back.Public().Equal(pub))

	_, err = release.ParsePublicKey("ssh-ed25519 AAAA")
	assert.Error(t, err)
	_, err = release.ParsePublicKey(pub.String()[:30])
	assert.Error(t, err)
	_, err = release.ParsePrivateKey([]byte("not a key"))
	assert.Error(t, err)
}

func TestSigningRefusesABuildThatCannotBeNamed(t *testing.T) {
	_, priv, err := release.GenerateKey()
	require.NoError(t, err)
	_, b := writeBuild(t, []byte("x"))
	b.Version = "v1\nlinux"
	_, err = release.Sign(priv, b)
	assert.Error(t, err, "a newline would let two builds sign the same bytes")
}

func TestInspectReadsTheVersionTheBinaryWasLinkedWith(t *testing.T) {
	// The test binary itself is a Go binary; its version comes from no -X.
	exe, err := os.Executable()
	require.NoError(t, err)
	b, err := release.Inspect(exe)
	require.NoError(t, err)
	assert.NotEmpty(t, b.OS)
	assert.NotEmpty(t, b.Arch)
	assert.Len(t, b.SHA256, 64)

	_, err = release.Inspect(filepath.Join(t.TempDir(), "missing"))
	assert.Error(t, err)
}
