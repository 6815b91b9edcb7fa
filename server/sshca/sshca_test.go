package sshca_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
	"golang.org/x/crypto/ssh/knownhosts"

	"github.com/a73x/eitri/server/sshca"
	"github.com/a73x/eitri/server/sshca/sshcatest"
)

func newPub(t *testing.T) ssh.PublicKey {
	t.Helper()
	pk, _, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	pub, err := ssh.NewPublicKey(pk)
	require.NoError(t, err)
	return pub
}

func TestLoadOrCreateKeepsTheCAsAcrossRestarts(t *testing.T) {
	dir := t.TempDir()
	a, err := sshca.LoadOrCreate(dir)
	require.NoError(t, err)
	b, err := sshca.LoadOrCreate(dir)
	require.NoError(t, err)
	for _, k := range []sshca.Kind{sshca.User, sshca.Host} {
		assert.Equal(t, a.PublicKey(k).Marshal(), b.PublicKey(k).Marshal(), "%s CA changed on restart", k)
		assert.Equal(t, ssh.KeyAlgoED25519, a.PublicKey(k).Type())
	}
	assert.NotEqual(t, a.PublicKey(sshca.User).Marshal(), a.PublicKey(sshca.Host).Marshal(), "user and host CA must differ")
}

func TestUserCertificateIsCheckedByValidityAndPrincipal(t *testing.T) {
	a, err := sshca.LoadOrCreate(t.TempDir())
	require.NoError(t, err)
	now := time.Now()
	user := newPub(t)
	cert, err := a.Sign(sshca.User, user, "alice@vm-1", []string{"eitri"}, sshca.Validity{After: now.Add(-time.Minute), Before: now.Add(5 * time.Minute)})
	require.NoError(t, err)

	caKey := a.PublicKey(sshca.User)
	checker := func(at time.Time) *ssh.CertChecker {
		return &ssh.CertChecker{
			IsUserAuthority: func(k ssh.PublicKey) bool { return string(k.Marshal()) == string(caKey.Marshal()) },
			Clock:           func() time.Time { return at },
		}
	}
	require.NoError(t, login(checker(now), "eitri", cert))
	assert.ErrorContains(t, login(checker(now), "root", cert), "not in the set of valid principals")
	assert.ErrorContains(t, login(checker(now.Add(6*time.Minute)), "eitri", cert), "expired")

	// The host CA does not vouch for users.
	hostCA := a.PublicKey(sshca.Host)
	_, err = (&ssh.CertChecker{IsUserAuthority: func(k ssh.PublicKey) bool { return string(k.Marshal()) == string(hostCA.Marshal()) }}).
		Authenticate(sshcatest.ConnMeta("eitri"), cert)
	assert.Error(t, err)

	_, err = a.Sign(sshca.User, user, "x", nil, sshca.Validity{After: now, Before: now.Add(time.Minute)})
	assert.Error(t, err, "a certificate without principals is valid for everyone")
}

// A host certificate that names more than eitri's alias (a tenant's VM
// name such as "localhost", as they once did) must not verify for those
// names: the known_hosts line limits the host CA to eitri's aliases.
func TestTheKnownHostsLineTrustsTheHostCAForEitriAliasesOnly(t *testing.T) {
	a, err := sshca.LoadOrCreate(t.TempDir())
	require.NoError(t, err)
	now := time.Now()
	cert, err := a.Sign(sshca.Host, newPub(t), "guest", []string{"vm-1", "eitri-vm-1", "localhost", "web"},
		sshca.Validity{After: now.Add(-time.Minute), Before: now.Add(time.Hour)})
	require.NoError(t, err)
	path := filepath.Join(t.TempDir(), "known_hosts")
	require.NoError(t, os.WriteFile(path, []byte(sshca.KnownHostsLine(a.PublicKey(sshca.Host))+"\n"), 0o600))
	check, err := knownhosts.New(path)
	require.NoError(t, err)
	remote := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 22}
	assert.NoError(t, check("eitri-vm-1:22", remote, cert), "the alias eitri ssh connects to")
	for _, name := range []string{"localhost", "web", "vm-1"} {
		assert.Error(t, check(name+":22", remote, cert), "the host CA vouches for no %s", name)
	}
}

func TestSerialsDiffer(t *testing.T) {
	seen := map[uint64]bool{}
	for range 1000 {
		s, err := sshca.Serial()
		require.NoError(t, err)
		require.False(t, seen[s], "serial %d repeated", s)
		seen[s] = true
	}
}

func TestRotateKeepsThePreviousKeyTrusted(t *testing.T) {
	dir := t.TempDir()
	a, err := sshca.LoadOrCreate(dir)
	require.NoError(t, err)
	first := a.PublicKey(sshca.Host)
	require.Len(t, a.Trusted(sshca.Host), 1)

	require.NoError(t, a.Rotate(sshca.Host))
	second := a.PublicKey(sshca.Host)
	assert.NotEqual(t, first.Marshal(), second.Marshal())
	trusted := a.Trusted(sshca.Host)
	require.Len(t, trusted, 2)
	assert.Equal(t, second.Marshal(), trusted[0].Marshal(), "current key first")
	assert.Equal(t, first.Marshal(), trusted[1].Marshal(), "previous key still trusted")
	assert.Len(t, a.Trusted(sshca.User), 1, "rotating the host CA leaves the user CA alone")

	// Survives a restart.
	b, err := sshca.LoadOrCreate(dir)
	require.NoError(t, err)
	require.Len(t, b.Trusted(sshca.Host), 2)
	assert.Equal(t, first.Marshal(), b.Trusted(sshca.Host)[1].Marshal())

	// A second rotation drops the first key.
	require.NoError(t, b.Rotate(sshca.Host))
	trusted = b.Trusted(sshca.Host)
	require.Len(t, trusted, 2)
	assert.Equal(t, second.Marshal(), trusted[1].Marshal())
	assert.Equal(t, "@cert-authority eitri-* "+sshca.AuthorizedKey(trusted[0]), sshca.KnownHostsLine(trusted[0]))
}

// Reload is how a replica takes a rotation another replica wrote to the
// shared files: it reads both CAs again, and never makes one.
func TestReloadReadsARotationMadeByAnotherAuthority(t *testing.T) {
	dir := t.TempDir()
	a, err := sshca.LoadOrCreate(dir)
	require.NoError(t, err)
	b, err := sshca.LoadOrCreate(dir)
	require.NoError(t, err)
	require.NoError(t, b.Rotate(sshca.User))

	require.NoError(t, a.Reload())
	assert.Equal(t, b.PublicKey(sshca.User).Marshal(), a.PublicKey(sshca.User).Marshal())
	require.Len(t, a.Trusted(sshca.User), 2, "the previous key comes along")
	assert.Equal(t, b.PublicKey(sshca.Host).Marshal(), a.PublicKey(sshca.Host).Marshal())

	require.NoError(t, os.Remove(filepath.Join(dir, "host_ca")))
	assert.ErrorIs(t, a.Reload(), os.ErrNotExist, "a missing CA is an error, not a new CA")
	assert.Equal(t, b.PublicKey(sshca.Host).Marshal(), a.PublicKey(sshca.Host).Marshal(), "a failed reload keeps what it had")
}

// login is sshd's check of a user certificate: signed by a trusted user CA
// (CertChecker.CheckCert alone does not look at the signer), valid now,
// for this user.
func login(c *ssh.CertChecker, user string, cert *ssh.Certificate) error {
	_, err := c.Authenticate(sshcatest.ConnMeta(user), cert)
	return err
}

func TestARotationCutShortLeavesOneKey(t *testing.T) {
	dir := t.TempDir()
	a, err := sshca.LoadOrCreate(dir)
	require.NoError(t, err)
	// What a crash between Rotate's first and second write leaves: the
	// current key recorded as previous too.
	require.NoError(t, os.WriteFile(filepath.Join(dir, "user_ca.previous.pub"), ssh.MarshalAuthorizedKey(a.PublicKey(sshca.User)), 0o644))
	b, err := sshca.LoadOrCreate(dir)
	require.NoError(t, err)
	assert.Len(t, b.Trusted(sshca.User), 1)
}
