package api_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"net"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/types/known/durationpb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server/sshca/sshcatest"
)

func (e *env) ssh(tok string) eitriv1connect.SSHServiceClient {
	return eitriv1connect.NewSSHServiceClient(e.http, e.url, bearer(tok))
}

func (e *env) user(name string) string {
	e.t.Helper()
	tok, err := e.tokens(e.admin).CreateToken(context.Background(), connect.NewRequest(&eitriv1.CreateTokenRequest{Name: "t", UserName: name}))
	require.NoError(e.t, err)
	return tok.Msg.Secret
}

func newSSHKey(t *testing.T) ssh.PublicKey {
	t.Helper()
	pk, _, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	pub, err := ssh.NewPublicKey(pk)
	require.NoError(t, err)
	return pub
}

func authorized(k ssh.PublicKey) string { return string(bytes.TrimSpace(ssh.MarshalAuthorizedKey(k))) }

func parseCert(t *testing.T, line string) *ssh.Certificate {
	t.Helper()
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line))
	require.NoError(t, err)
	cert, ok := k.(*ssh.Certificate)
	require.True(t, ok, "%T is not a certificate", k)
	return cert
}

func isKey(want string) func(ssh.PublicKey) bool {
	return func(k ssh.PublicKey) bool { return authorized(k) == want }
}

func TestSignUserKeyCertifiesTheLoginUserOfTheCallersVMOnly(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice, bob := e.user("alice"), e.user("bob")

	cas, err := e.ssh(alice).GetSSHCAKeys(ctx, connect.NewRequest(&eitriv1.GetSSHCAKeysRequest{}))
	require.NoError(t, err, "any user reads the CA keys")
	require.Len(t, cas.Msg.UserCaKeys, 1)
	require.Len(t, cas.Msg.HostCaKeys, 1)
	userCA := cas.Msg.UserCaKeys[0].PublicKey
	assert.Equal(t, []string{"@cert-authority eitri-* " + cas.Msg.HostCaKeys[0].PublicKey}, cas.Msg.KnownHosts,
		"the host CA is trusted for eitri's aliases only")
	assert.NotEqual(t, userCA, cas.Msg.HostCaKeys[0].PublicKey)

	created, err := e.vms(alice).CreateVM(ctx, connect.NewRequest(createReq("web")))
	require.NoError(t, err)
	id := created.Msg.Vm.Id
	snap := a.next(t)
	require.Len(t, snap.Vms, 1)
	assert.Equal(t, []string{userCA}, snap.Vms[0].SshUserCaKeys, "the guest is told to trust the user CA")

	key := newSSHKey(t)
	sign := func(tok string, r *eitriv1.SignUserKeyRequest) (*eitriv1.SignUserKeyResponse, error) {
		resp, err := e.ssh(tok).SignUserKey(ctx, connect.NewRequest(r))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	_, err = sign(alice, &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(key)})
	assert.Equal(t, connect.CodeFailedPrecondition, code(err), "no login user reported yet: no certificate (never one without a principal)")

	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{{VmId: id, Power: "running", Phase: "ready", LoginUser: "eitri"}}})
	require.Eventually(t, func() bool {
		v, err := e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		return err == nil && v.Msg.Vm.LoginUser == "eitri"
	}, 5*time.Second, 10*time.Millisecond)

	before := time.Now()
	got, err := sign(alice, &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(key)})
	require.NoError(t, err)
	cert := parseCert(t, got.Certificate)
	assert.Equal(t, uint32(ssh.UserCert), cert.CertType)
	assert.Equal(t, key.Marshal(), cert.Key.Marshal(), "the caller's key is certified")
	// sshd accepts this principal for the login user on this VM alone (its
	// seed's AuthorizedPrincipalsFile): every guest trusts the same CA.
	principal := "eitri@" + id
	assert.Equal(t, []string{principal}, cert.ValidPrincipals, "the login user on this VM is the only principal")
	assert.Equal(t, principal, got.Principal)
	assert.Equal(t, "eitri", got.LoginUser)
	assert.Equal(t, cert.Serial, got.Serial)
	assert.Contains(t, cert.KeyId, "alice")
	assert.Contains(t, cert.KeyId, id)
	assert.Equal(t, cert.KeyId, got.KeyId)
	life := got.ValidBefore.AsTime().Sub(before)
	assert.True(t, life > 4*time.Minute && life <= 5*time.Minute+time.Second, "default TTL is 5 minutes, got %s", life)

	checker := func(at time.Time, ca string) *ssh.CertChecker {
		return &ssh.CertChecker{IsUserAuthority: isKey(ca), Clock: func() time.Time { return at }}
	}
	require.NoError(t, login(checker(time.Now(), userCA), principal, cert), "sshd's check with the user CA accepts it")
	assert.Error(t, login(checker(time.Now(), userCA), "root@"+id, cert), "for the login user only")
	assert.Error(t, login(checker(time.Now(), userCA), "eitri", cert), "never for the user name alone, which every guest has")
	_, err = checker(time.Now(), cas.Msg.HostCaKeys[0].PublicKey).Authenticate(sshcatest.ConnMeta(principal), cert)
	assert.Error(t, err, "not signed by the host CA")
	assert.ErrorContains(t, login(checker(got.ValidBefore.AsTime().Add(time.Second), userCA), principal, cert), "expired",
		"an expired certificate is refused")

	evs, err := e.vms(alice).ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: id}))
	require.NoError(t, err)
	var recorded *eitriv1.VMEvent
	for _, ev := range evs.Msg.Events {
		if ev.Kind == "ssh-cert" {
			recorded = ev
		}
	}
	require.NotNil(t, recorded, "the certificate is recorded on the VM")
	assert.Contains(t, recorded.Message, "alice")
	assert.Contains(t, recorded.Message, ssh.FingerprintSHA256(key))
	assert.Contains(t, recorded.Message, "serial")

	again, err := sign(alice, &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(key), Ttl: durationpb.New(30 * time.Minute)})
	require.NoError(t, err)
	assert.NotEqual(t, got.Serial, again.Serial, "serials are unique")
	assert.InDelta(t, 30*time.Minute, again.ValidBefore.AsTime().Sub(before), float64(10*time.Second))

	_, err = sign(bob, &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(newSSHKey(t))})
	assert.Equal(t, connect.CodeNotFound, code(err), "another user's VM does not exist for you")
	_, err = sign(e.admin, &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(newSSHKey(t))})
	assert.NoError(t, err, "an admin may get into any VM")

	_, err = eitriv1connect.NewSSHServiceClient(e.http, e.url).SignUserKey(ctx, connect.NewRequest(&eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(key)}))
	assert.Equal(t, connect.CodeUnauthenticated, code(err))
	_, err = eitriv1connect.NewSSHServiceClient(e.http, e.url).GetSSHCAKeys(ctx, connect.NewRequest(&eitriv1.GetSSHCAKeysRequest{}))
	assert.Equal(t, connect.CodeUnauthenticated, code(err))

	rsaSmall, err := rsa.GenerateKey(rand.Reader, 1024)
	require.NoError(t, err)
	rsaPub, err := ssh.NewPublicKey(&rsaSmall.PublicKey)
	require.NoError(t, err)
	for _, c := range []struct {
		name  string
		req   *eitriv1.SignUserKeyRequest
		field string
	}{
		{"no key", &eitriv1.SignUserKeyRequest{VmId: id}, "public_key"},
		{"not a key", &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: "ssh-ed25519 bm90IGEga2V5"}, "public_key"},
		{"two lines", &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(key) + "\n" + authorized(key)}, "public_key"},
		{"weak RSA", &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(rsaPub)}, "public_key"},
		{"a certificate", &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: got.Certificate}, "public_key"},
		{"huge key", &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: "ssh-ed25519 " + string(bytes.Repeat([]byte("A"), 9000))}, "public_key"},
		{"ttl over the max", &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(key), Ttl: durationpb.New(2 * time.Hour)}, "ttl"},
		{"negative ttl", &eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(key), Ttl: durationpb.New(-time.Second)}, "ttl"},
		{"no vm", &eitriv1.SignUserKeyRequest{PublicKey: authorized(key)}, "vm_id"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := sign(alice, c.req)
			assert.Equal(t, connect.CodeInvalidArgument, code(err), "%v", err)
			assert.ErrorContains(t, err, c.field+":")
		})
	}
	evs2, err := e.vms(alice).ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: id}))
	require.NoError(t, err)
	n := 0
	for _, ev := range evs2.Msg.Events {
		if ev.Kind == "ssh-cert" {
			n++
		}
	}
	assert.Equal(t, 3, n, "refused requests record nothing")
}

func TestSignHostKeyCertifiesTheGuestsOfTheCallingHostOnly(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h1, cred1 := e.enroll("h1")
	e.connect(h1, cred1, big())
	h2, cred2 := e.enroll("h2")
	e.connect(h2, cred2, big())
	req := createReq("db")
	req.HostId = h1
	created, err := e.vms(e.admin).CreateVM(ctx, connect.NewRequest(req))
	require.NoError(t, err)
	vm := created.Msg.Vm
	cas, err := e.ssh(e.admin).GetSSHCAKeys(ctx, connect.NewRequest(&eitriv1.GetSSHCAKeysRequest{}))
	require.NoError(t, err)
	hostCA := cas.Msg.HostCaKeys[0].PublicKey

	agentClient := func(cred string) eitriv1connect.AgentServiceClient {
		return eitriv1connect.NewAgentServiceClient(e.http, e.url, bearer(cred))
	}
	key := newSSHKey(t)
	resp, err := agentClient(cred1).SignHostKey(ctx, connect.NewRequest(&eitriv1.SignHostKeyRequest{VmId: vm.Id, PublicKey: authorized(key)}))
	require.NoError(t, err)
	cert := parseCert(t, resp.Msg.Certificate)
	assert.Equal(t, uint32(ssh.HostCert), cert.CertType)
	assert.Equal(t, key.Marshal(), cert.Key.Marshal())
	assert.Equal(t, []string{vm.Id, "eitri-" + vm.Id}, cert.ValidPrincipals, "names eitri gives out only, never the VM's name")
	assert.WithinDuration(t, time.Now().Add(30*24*time.Hour), time.Unix(int64(cert.ValidBefore), 0), time.Minute, "a month: agents renew it")
	assert.WithinDuration(t, time.Now().Add(-time.Minute), time.Unix(int64(cert.ValidAfter), 0), 5*time.Second)

	// What an ssh client trusting the host CA for any name does: even so
	// the certificate vouches for the id and the alias alone.
	checker := &ssh.CertChecker{IsHostAuthority: func(k ssh.PublicKey, _ string) bool { return isKey(hostCA)(k) }}
	remote := &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: 22}
	assert.NoError(t, checker.CheckHostKey(vm.Id+":22", remote, cert), "verifies for the VM's id")
	assert.NoError(t, checker.CheckHostKey("eitri-"+vm.Id+":22", remote, cert), "and the alias eitri ssh uses")
	assert.Error(t, checker.CheckHostKey("db:22", remote, cert), "not for its name, which its owner chose")
	assert.Error(t, checker.CheckHostKey("other:22", remote, cert), "not for another guest")
	userChecker := &ssh.CertChecker{IsHostAuthority: func(k ssh.PublicKey, _ string) bool { return isKey(cas.Msg.UserCaKeys[0].PublicKey)(k) }}
	assert.Error(t, userChecker.CheckHostKey(vm.Id+":22", remote, cert), "not signed by the user CA")

	_, err = agentClient(cred2).SignHostKey(ctx, connect.NewRequest(&eitriv1.SignHostKeyRequest{VmId: vm.Id, PublicKey: authorized(key)}))
	assert.Equal(t, connect.CodeNotFound, code(err), "another host's guest")
	_, err = agentClient(e.admin).SignHostKey(ctx, connect.NewRequest(&eitriv1.SignHostKeyRequest{VmId: vm.Id, PublicKey: authorized(key)}))
	assert.Equal(t, connect.CodeUnauthenticated, code(err), "a user token is no host credential")
	_, err = eitriv1connect.NewAgentServiceClient(e.http, e.url).SignHostKey(ctx, connect.NewRequest(&eitriv1.SignHostKeyRequest{VmId: vm.Id, PublicKey: authorized(key)}))
	assert.Equal(t, connect.CodeUnauthenticated, code(err))

	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	require.NoError(t, err)
	rsaPub, err := ssh.NewPublicKey(&rsaKey.PublicKey)
	require.NoError(t, err)
	_, err = agentClient(cred1).SignHostKey(ctx, connect.NewRequest(&eitriv1.SignHostKeyRequest{VmId: vm.Id, PublicKey: authorized(rsaPub)}))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "public_key:")
}

func TestRotateSSHCAKeepsThePreviousKeyTrustedAndIsForAdmins(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice := e.user("alice")
	before, err := e.ssh(alice).GetSSHCAKeys(ctx, connect.NewRequest(&eitriv1.GetSSHCAKeysRequest{}))
	require.NoError(t, err)

	_, err = e.ssh(alice).RotateSSHCA(ctx, connect.NewRequest(&eitriv1.RotateSSHCARequest{Ca: "user"}))
	assert.Equal(t, connect.CodePermissionDenied, code(err), "only an admin rotates a CA")
	_, err = e.ssh(e.admin).RotateSSHCA(ctx, connect.NewRequest(&eitriv1.RotateSSHCARequest{Ca: "both"}))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "ca:")

	rotated, err := e.ssh(e.admin).RotateSSHCA(ctx, connect.NewRequest(&eitriv1.RotateSSHCARequest{Ca: "user"}))
	require.NoError(t, err)
	keys := rotated.Msg.Keys
	require.Len(t, keys.UserCaKeys, 2)
	assert.NotEqual(t, before.Msg.UserCaKeys[0].PublicKey, keys.UserCaKeys[0].PublicKey, "a new current key")
	assert.False(t, keys.UserCaKeys[0].Previous)
	assert.Equal(t, before.Msg.UserCaKeys[0].PublicKey, keys.UserCaKeys[1].PublicKey, "the old key is still trusted")
	assert.True(t, keys.UserCaKeys[1].Previous)
	assert.Len(t, keys.HostCaKeys, 1, "the host CA is untouched")

	_, err = e.vms(alice).CreateVM(ctx, connect.NewRequest(createReq("web")))
	require.NoError(t, err)
	var snap *eitriv1.DesiredStateSnapshot
	for snap = a.next(t); len(snap.Vms) == 0; snap = a.next(t) {
	}
	assert.Equal(t, []string{keys.UserCaKeys[0].PublicKey, keys.UserCaKeys[1].PublicKey}, snap.Vms[0].SshUserCaKeys,
		"new guests trust both keys")

	id := snap.Vms[0].VmId
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: []*eitriv1.ActualVM{{VmId: id, Power: "running", Phase: "ready", LoginUser: "eitri"}}})
	require.Eventually(t, func() bool {
		v, err := e.vms(alice).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
		return err == nil && v.Msg.Vm.LoginUser == "eitri"
	}, 5*time.Second, 10*time.Millisecond)
	got, err := e.ssh(alice).SignUserKey(ctx, connect.NewRequest(&eitriv1.SignUserKeyRequest{VmId: id, PublicKey: authorized(newSSHKey(t))}))
	require.NoError(t, err)
	cert := parseCert(t, got.Msg.Certificate)
	assert.NoError(t, login(&ssh.CertChecker{IsUserAuthority: isKey(keys.UserCaKeys[0].PublicKey)}, got.Msg.Principal, cert), "signed by the new key")
	assert.Error(t, login(&ssh.CertChecker{IsUserAuthority: isKey(keys.UserCaKeys[1].PublicKey)}, got.Msg.Principal, cert), "not by the old one")
}

// login is sshd's check of a user certificate: signed by a trusted user CA
// (CertChecker.CheckCert alone does not look at the signer), valid now,
// for this user.
func login(c *ssh.CertChecker, user string, cert *ssh.Certificate) error {
	_, err := c.Authenticate(sshcatest.ConnMeta(user), cert)
	return err
}

func TestSignUserKeyIsRateLimitedPerUser(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h, cred := e.enroll("h1")
	a := e.connect(h, cred, big())
	alice, bob := e.user("alice"), e.user("bob")
	var ids []string
	for _, tok := range []string{alice, bob} {
		created, err := e.vms(tok).CreateVM(ctx, connect.NewRequest(createReq("web")))
		require.NoError(t, err)
		ids = append(ids, created.Msg.Vm.Id)
		a.next(t)
	}
	var rows []*eitriv1.ActualVM
	for _, id := range ids {
		rows = append(rows, &eitriv1.ActualVM{VmId: id, Power: "running", Phase: "ready", LoginUser: "eitri"})
	}
	a.report(t, &eitriv1.ActualStateReport{Capacity: big(), Vms: rows})
	require.Eventually(t, func() bool {
		v, err := e.vms(bob).GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: ids[1]}))
		return err == nil && v.Msg.Vm.LoginUser == "eitri"
	}, 5*time.Second, 10*time.Millisecond)

	key := authorized(newSSHKey(t))
	var err error
	n := 0
	for ; n < 100; n++ {
		if _, err = e.ssh(alice).SignUserKey(ctx, connect.NewRequest(&eitriv1.SignUserKeyRequest{VmId: ids[0], PublicKey: key})); err != nil {
			break
		}
	}
	assert.Equal(t, connect.CodeResourceExhausted, code(err), "%v", err)
	assert.GreaterOrEqual(t, n, 20, "a burst is allowed")
	assert.Less(t, n, 30, "then the rate is bounded")
	_, err = e.ssh(bob).SignUserKey(ctx, connect.NewRequest(&eitriv1.SignUserKeyRequest{VmId: ids[1], PublicKey: key}))
	assert.NoError(t, err, "one user's rate is not another's")
}
