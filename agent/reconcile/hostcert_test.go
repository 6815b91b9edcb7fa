package reconcile

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
)

// testHostCA signs host keys as the control plane would, recording the
// calls.
type testHostCA struct {
	signer ssh.Signer
	mu     sync.Mutex
	calls  []string // vm ids
}

func newTestHostCA(t *testing.T) *testHostCA {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	s, err := ssh.NewSignerFromKey(priv)
	require.NoError(t, err)
	return &testHostCA{signer: s}
}

func (c *testHostCA) sign(_ context.Context, vmID, pub string) (string, error) {
	c.mu.Lock()
	c.calls = append(c.calls, vmID)
	c.mu.Unlock()
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(pub))
	if err != nil {
		return "", err
	}
	cert := &ssh.Certificate{Key: k, CertType: ssh.HostCert, ValidPrincipals: []string{vmID}, ValidBefore: ssh.CertTimeInfinity}
	if err := cert.SignCert(rand.Reader, c.signer); err != nil {
		return "", err
	}
	return string(ssh.MarshalAuthorizedKey(cert)), nil
}

func TestTheSeedCarriesTheHostCertificateAndTheTrustedUserCAs(t *testing.T) {
	ca := newTestHostCA(t)
	f := setup(t, func(c *Config) { c.SignHostKey = ca.sign })
	d := vm("vm1")
	d.SshUserCaKeys = []string{"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHf7 user-ca"}
	rep := f.apply(snap(1, d))
	assert.Equal(t, "ready", findVM(rep, "vm1").GetPhase())

	p := f.seeds.last()
	assert.Equal(t, d.SshUserCaKeys, p.TrustedUserCAKeys, "the guest trusts the CAs the desired state names")
	require.NotEmpty(t, p.HostCertificate)
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(p.HostCertificate))
	require.NoError(t, err)
	cert := k.(*ssh.Certificate)
	pub, _, _, _, err := ssh.ParseAuthorizedKey([]byte(p.HostPubKey))
	require.NoError(t, err)
	assert.Equal(t, pub.Marshal(), cert.Key.Marshal(), "the certificate is for the guest's own host key")
	checker := &ssh.CertChecker{IsHostAuthority: func(a ssh.PublicKey, _ string) bool {
		return string(a.Marshal()) == string(ca.signer.PublicKey().Marshal())
	}}
	assert.NoError(t, checker.CheckHostKey("vm1:22", nil, cert))
	assert.Equal(t, p.HostCertificate, f.record("vm1").HostCert, "kept, so a retried create does not ask again")
	assert.Equal(t, []string{"vm1"}, ca.calls)

	rows, _ := narrate(t, setup(t, func(c *Config) { c.SignHostKey = ca.sign }), context.Background(), vm("vm2"))
	assert.Equal(t, []string{"waiting for a create slot on this host", "downloading image", "preparing root disk",
		"certifying the SSH host key", "building the cloud-init seed", "booting"}, details(rows))
}

func TestAGuestWhoseKeyCannotBeCertifiedStillBoots(t *testing.T) {
	otherCA := newTestHostCA(t)
	for name, signer := range map[string]HostKeySigner{
		"control plane unreachable": func(context.Context, string, string) (string, error) {
			return "", errors.New("dial tcp: connection refused")
		},
		"a certificate for another key": func(ctx context.Context, id, _ string) (string, error) {
			_, pub, err := ed25519.GenerateKey(rand.Reader)
			if err != nil {
				return "", err
			}
			k, _ := ssh.NewPublicKey(pub.Public())
			return otherCA.sign(ctx, id, strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k))))
		},
		"not a certificate": func(context.Context, string, string) (string, error) { return "garbage", nil },
	} {
		t.Run(name, func(t *testing.T) {
			f := setup(t, func(c *Config) { c.SignHostKey = signer })
			rep := f.apply(snap(1, vm("vm1")))
			row := findVM(rep, "vm1")
			assert.Equal(t, "ready", row.GetPhase(), "no certificate is no reason to fail a guest")
			assert.Empty(t, row.GetLastError())
			assert.Empty(t, f.seeds.last().HostCertificate, "the guest boots uncertified")
			assert.Empty(t, f.record("vm1").HostCert)

			rows, _ := narrate(t, setup(t, func(c *Config) { c.SignHostKey = signer }), context.Background(), vm("vm2"))
			said := details(rows)
			assert.Contains(t, said, "certifying the SSH host key")
			found := false
			for _, d := range said {
				found = found || strings.HasPrefix(d, "building the cloud-init seed; SSH host key not certified")
			}
			assert.True(t, found, "the create says the guest boots uncertified: %q", said)
		})
	}
}
