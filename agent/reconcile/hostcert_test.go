package reconcile

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
)

// testHostCA signs host keys as the control plane would, for a month from
// now, recording the calls.
type testHostCA struct {
	signer ssh.Signer
	now    func() time.Time // nil: time.Now
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
	now := time.Now()
	if c.now != nil {
		now = c.now()
	}
	cert := &ssh.Certificate{Key: k, CertType: ssh.HostCert, ValidPrincipals: []string{vmID},
		ValidAfter: uint64(now.Add(-time.Minute).Unix()), ValidBefore: uint64(now.Add(30 * 24 * time.Hour).Unix())}
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

func (c *testHostCA) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.calls)
}

func validity(t *testing.T, line string) (after, before time.Time) {
	t.Helper()
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line))
	require.NoError(t, err)
	cert := k.(*ssh.Certificate)
	return time.Unix(int64(cert.ValidAfter), 0).UTC(), time.Unix(int64(cert.ValidBefore), 0).UTC()
}

func TestARunningGuestsHostCertificateIsRenewedTenDaysIn(t *testing.T) {
	ca := newTestHostCA(t)
	f := setup(t, func(c *Config) { c.SignHostKey = ca.sign; c.ResyncInterval = 5 * time.Millisecond })
	ca.now = f.clock.Now
	f.apply(snap(1, vm("vm1")))
	first := f.record("vm1").HostCert
	require.NotEmpty(t, first)
	require.Equal(t, 1, ca.count())

	f.clock.Advance(9 * 24 * time.Hour)
	f.waitPasses("vm1", 3)
	assert.Equal(t, 1, ca.count(), "a certificate with two thirds of its life left is kept")
	assert.Equal(t, first, f.record("vm1").HostCert)

	f.clock.Advance(24 * time.Hour)
	require.Eventually(t, func() bool { return f.record("vm1").HostCert != first }, 5*time.Second, time.Millisecond,
		"ten days in, the certificate is renewed")
	renewed := f.record("vm1").HostCert
	after, before := validity(t, renewed)
	assert.Equal(t, f.clock.Now().Add(-time.Minute), after, "signed now")
	assert.Equal(t, f.clock.Now().Add(30*24*time.Hour), before)
	f.waitPasses("vm1", 3)
	assert.Equal(t, 2, ca.count(), "once")
	assert.Equal(t, renewed, f.record("vm1").HostCert)
}

func TestAFailedRenewalIsTriedAgainAnHourLaterAndAnUncertifiedGuestGetsOne(t *testing.T) {
	ca := newTestHostCA(t)
	var mu sync.Mutex
	down, calls := true, 0
	f := setup(t, func(c *Config) {
		c.ResyncInterval = 5 * time.Millisecond
		c.SignHostKey = func(ctx context.Context, id, pub string) (string, error) {
			mu.Lock()
			defer mu.Unlock()
			calls++
			if down {
				return "", errors.New("dial tcp: connection refused")
			}
			return ca.sign(ctx, id, pub)
		}
	})
	ca.now = f.clock.Now
	tries := func() int { mu.Lock(); defer mu.Unlock(); return calls }
	f.apply(snap(1, vm("vm1")))
	require.Empty(t, f.record("vm1").HostCert, "created while the control plane was down")
	f.waitPasses("vm1", 3)
	require.Equal(t, 2, tries(), "the create asked, and the first pass after it")

	mu.Lock()
	down = false
	mu.Unlock()
	f.clock.Advance(59 * time.Minute)
	f.waitPasses("vm1", 3)
	assert.Equal(t, 2, tries(), "not within the hour")
	f.clock.Advance(time.Minute)
	require.Eventually(t, func() bool { return f.record("vm1").HostCert != "" }, 5*time.Second, time.Millisecond,
		"an hour on, the guest has a certificate to fetch")
	assert.Equal(t, 3, tries())
}

func TestAStoppedGuestsCertificateIsNotRenewedUntilItIsWantedRunning(t *testing.T) {
	ca := newTestHostCA(t)
	f := setup(t, func(c *Config) { c.SignHostKey = ca.sign; c.ResyncInterval = 5 * time.Millisecond })
	ca.now = f.clock.Now
	f.apply(snap(1, stopped(vm("vm1"))))
	require.Equal(t, 1, ca.count())
	f.clock.Advance(20 * 24 * time.Hour)
	f.waitPasses("vm1", 3)
	assert.Equal(t, 1, ca.count(), "nobody can reach a stopped guest")

	first := f.record("vm1").HostCert
	f.apply(snap(2, vm("vm1")))
	assert.NotEqual(t, first, f.record("vm1").HostCert, "renewed before the start, so the guest boots to a current one")
	assert.Equal(t, 2, ca.count())
}

func TestWhenAHostCertificateIsDue(t *testing.T) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	signer, err := ssh.NewSignerFromKey(priv)
	require.NoError(t, err)
	t0 := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC)
	cert := func(after time.Time, before uint64) string {
		c := &ssh.Certificate{Key: signer.PublicKey(), CertType: ssh.HostCert, ValidPrincipals: []string{"vm-1"},
			ValidAfter: uint64(after.Unix()), ValidBefore: before}
		require.NoError(t, c.SignCert(rand.Reader, signer))
		return string(ssh.MarshalAuthorizedKey(c))
	}
	at := func(d time.Duration) uint64 { return uint64(t0.Add(d).Unix()) }
	day := 24 * time.Hour
	for _, c := range []struct {
		what string
		line string
		now  time.Time
		due  bool
	}{
		{"none", "", t0, true},
		{"unreadable", "garbage", t0, true},
		{"a month's, nine days in", cert(t0, at(30*day)), t0.Add(9 * day), false},
		{"a month's, ten days in", cert(t0, at(30*day)), t0.Add(10 * day), true},
		{"five years', a day in", cert(t0, at(5*365*day)), t0.Add(day), false},
		{"five years', ten days in (signed before certificates were short)", cert(t0, at(5*365*day)), t0.Add(10 * day), true},
		{"three days', a day in", cert(t0, at(3*day)), t0.Add(day), true},
		{"three days', half a day in", cert(t0, at(3*day)), t0.Add(day / 2), false},
		{"forever, new", cert(t0, ssh.CertTimeInfinity), t0.Add(day), false},
		{"forever, ten days in", cert(t0, ssh.CertTimeInfinity), t0.Add(10 * day), true},
	} {
		assert.Equal(t, c.due, !c.now.Before(hostCertRenewAt(c.line)), c.what)
	}
}
