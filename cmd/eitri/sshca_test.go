package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/a73x/eitri/agent/hosttest"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/sshcert"
)

func TestSSHCAPrintsTheKeysAndTheKnownHostsLine(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	out, err := e.eitri("ssh-ca", "-o", "json")
	require.NoError(t, err)
	var r eitriv1.GetSSHCAKeysResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &r), out)
	require.Len(t, r.HostCaKeys, 1)
	require.Len(t, r.UserCaKeys, 1)
	line := "@cert-authority eitri-* " + r.HostCaKeys[0].PublicKey
	assert.Equal(t, []string{line}, r.KnownHosts, "the host CA is trusted for eitri's aliases only")

	out, err = e.eitri("ssh-ca", "--known-hosts")
	require.NoError(t, err)
	assert.Equal(t, line+"\n", out, "ready to append to ~/.ssh/known_hosts")

	out, err = e.eitri("ssh-ca")
	require.NoError(t, err)
	assert.Contains(t, out, r.UserCaKeys[0].PublicKey)
	assert.Contains(t, out, r.UserCaKeys[0].Fingerprint)
	assert.Contains(t, out, line)

	out, err = e.eitri("ssh-ca", "rotate", "host")
	require.NoError(t, err)
	assert.Regexp(t, `previous\s+\S+\s+`+regexp.QuoteMeta(r.HostCaKeys[0].PublicKey), out, "the old host key is listed as previous")
	out, err = e.eitri("ssh-ca", "--known-hosts")
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(out), "\n")
	require.Len(t, lines, 2, "both host keys are trusted:\n%s", out)
	assert.Equal(t, line, lines[1], "the old one second")
	_, err = e.eitri("ssh-ca", "rotate", "everything")
	assert.ErrorContains(t, err, "invalid argument: ca:")
}

// sshVM is a VM on a scripted host that reports login as its login user.
func sshVM(t *testing.T, e *cliEnv, login string) (vmID string, host *scriptedHost) {
	t.Helper()
	h := e.connectHost("h1")
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "running", Phase: "ready", Ip: "10.77.0.9", LoginUser: login}
	})
	vm, err := e.srv.Fleet.CreateVM(e.adminCtx(), &eitriv1.CreateVMRequest{Name: "web", ImageUrl: "http://images.test/g.raw",
		ImageSha256: strings.Repeat("ab", 32), Vcpus: 1, MemMb: 256, DiskGb: 1})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		v, err := e.srv.Fleet.GetVM(e.adminCtx(), vm.Id)
		return err == nil && v.LoginUser == login
	}, 10*time.Second, 10*time.Millisecond, "the host reports the login user")
	return vm.Id, h
}

func TestSSHLoginWritesAPrivateKeyAndItsCertificate(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	vmID, _ := sshVM(t, e, "eitri")
	l, err := cli.NewSSHLogin(context.Background(), t.TempDir(), vmID, 0)
	require.NoError(t, err)
	info, err := os.Stat(l.Dir)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), info.Mode().Perm(), "the private key's directory is the user's alone")
	for _, f := range []string{l.IdentityFile, l.CertificateFile, l.KnownHostsFile} {
		info, err := os.Stat(f)
		require.NoError(t, err)
		assert.Equal(t, os.FileMode(0o600), info.Mode().Perm(), f)
	}
	certBytes, err := os.ReadFile(l.CertificateFile)
	require.NoError(t, err)
	k, _, _, _, err := ssh.ParseAuthorizedKey(certBytes)
	require.NoError(t, err)
	cert := k.(*ssh.Certificate)
	keyBytes, err := os.ReadFile(l.IdentityFile)
	require.NoError(t, err)
	signer, err := ssh.ParsePrivateKey(keyBytes)
	require.NoError(t, err)
	assert.Equal(t, signer.PublicKey().Marshal(), cert.Key.Marshal(), "the certificate is for the key beside it")
	assert.Equal(t, []string{"eitri@" + vmID}, cert.ValidPrincipals, "the login user on this VM")
	assert.Equal(t, "eitri", l.User)
	assert.WithinDuration(t, time.Now().Add(5*time.Minute), l.ValidBefore, time.Minute)
	kh, err := os.ReadFile(l.KnownHostsFile)
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(string(kh), "@cert-authority eitri-* ssh-ed25519 "), string(kh))

	require.NoError(t, l.Remove())
	_, err = os.Stat(l.Dir)
	assert.True(t, os.IsNotExist(err), "Remove leaves no key behind")
}

// sshdPath is Debian's sshd, which tests run on loopback as a guest's.
const sshdPath = "/usr/sbin/sshd"

// needSSHD skips a test without sshd or one of the client tools it names,
// and returns the user the test runs as.
func needSSHD(t *testing.T, tools ...string) *user.User {
	t.Helper()
	if _, err := os.Stat(sshdPath); err != nil {
		t.Skip("needs openssh-server (make deps)")
	}
	for _, bin := range tools {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("needs %s (make deps)", bin)
		}
	}
	me, err := user.Current()
	require.NoError(t, err)
	if me.Uid == "0" {
		// sshd refuses to start without its privilege separation directory.
		require.NoError(t, os.MkdirAll("/run/sshd", 0o755))
	}
	return me
}

// writeSSHKey writes a new ed25519 private key to path, as ssh and sshd
// read one.
func writeSSHKey(t *testing.T, path string) ssh.Signer {
	t.Helper()
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	block, err := ssh.MarshalPrivateKey(priv, "")
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(path, pem.EncodeToMemory(block), 0o600))
	s, err := ssh.NewSignerFromKey(priv)
	require.NoError(t, err)
	return s
}

// startSSHD runs sshd until the test ends, on a free loopback port, with
// hostKey and its certificate hostCert, no passwords, and the further
// sshd_config lines in config. It returns the port once sshd listens, and
// sshd's log.
func startSSHD(t *testing.T, hostKey, hostCert, config string) (int, *outputtest.Buffer) {
	t.Helper()
	dir := t.TempDir()
	port := hosttest.FreePort(t, "tcp")
	conf := filepath.Join(dir, "sshd_config")
	require.NoError(t, os.WriteFile(conf, []byte(fmt.Sprintf(`ListenAddress 127.0.0.1:%d
HostKey %s
HostCertificate %s
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
PermitRootLogin prohibit-password
PidFile %s
`, port, hostKey, hostCert, filepath.Join(dir, "sshd.pid"))+config), 0o600))
	sshdLog := &outputtest.Buffer{}
	daemon := exec.Command(sshdPath, "-D", "-e", "-f", conf)
	daemon.Stdout, daemon.Stderr = sshdLog, sshdLog
	require.NoError(t, daemon.Start())
	t.Cleanup(func() { _ = daemon.Process.Kill(); _ = daemon.Wait() })
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	require.Eventually(t, func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			c.Close()
		}
		return err == nil
	}, 10*time.Second, 20*time.Millisecond, "sshd listens:\n%s", sshdLog)
	return port, sshdLog
}

// TestSSHCertificatesGetIntoARealSSHD runs Debian's sshd on loopback,
// configured as a guest's seed configures it (TrustedUserCAKeys,
// HostCertificate), with a host key the control plane certified through
// the agent's RPC, and logs in with the system ssh and a certificate from
// NewSSHLogin, trusting only the host CA's known_hosts line.
func TestSSHCertificatesGetIntoARealSSHD(t *testing.T) {
	me := needSSHD(t, "ssh")
	e := newCLIEnv(t, server.Config{})
	vmID, scripted := sshVM(t, e, me.Username)
	host := scripted.id
	ctx := context.Background()

	// The guest's host key, certified as the agent has it certified.
	dir := t.TempDir()
	hostKeyPath := filepath.Join(dir, "ssh_host_ed25519_key")
	sshPub := writeSSHKey(t, hostKeyPath).PublicKey()
	agentAPI := eitriv1connect.NewAgentServiceClient(connclient.HTTPClient(""), host.ServerURL, connect.WithInterceptors(connclient.Bearer(host.Credential)))
	hc, err := agentAPI.SignHostKey(ctx, connect.NewRequest(&eitriv1.SignHostKeyRequest{VmId: vmID, PublicKey: string(ssh.MarshalAuthorizedKey(sshPub))}))
	require.NoError(t, err)
	hostCert := filepath.Join(dir, "eitri_host_ed25519_cert.pub")
	require.NoError(t, os.WriteFile(hostCert, []byte(hc.Msg.Certificate+"\n"), 0o644))

	userCAs, err := e.eitri("ssh-ca", "-o", "json")
	require.NoError(t, err)
	var cas eitriv1.GetSSHCAKeysResponse
	require.NoError(t, protojson.Unmarshal([]byte(userCAs), &cas))
	caFile := filepath.Join(dir, "eitri_user_ca.pub")
	require.NoError(t, os.WriteFile(caFile, []byte(cas.UserCaKeys[0].PublicKey+"\n"), 0o644))

	// As the seed does: the login user takes certificates for this VM's
	// principal only.
	principals := filepath.Join(dir, "principals")
	require.NoError(t, os.MkdirAll(principals, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(principals, me.Username), []byte(me.Username+"@"+vmID+"\n"), 0o644))

	port, sshdLog := startSSHD(t, hostKeyPath, hostCert, fmt.Sprintf(`TrustedUserCAKeys %s
AuthorizedPrincipalsFile %s/%%u
AuthorizedKeysFile none
LogLevel VERBOSE
`, caFile, principals))

	login := func(ttl time.Duration) *cli.SSHLogin {
		l, err := cli.NewSSHLogin(ctx, t.TempDir(), vmID, ttl)
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Remove() })
		return l
	}
	runSSH := func(opts []string) (string, error) {
		args := append([]string{"-F", "/dev/null", "-p", strconv.Itoa(port), "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"}, opts...)
		out, err := exec.Command("ssh", append(args, "127.0.0.1", "echo", "in-the-guest")...).CombinedOutput()
		return string(out), err
	}

	l := login(0)
	out, err := runSSH(l.SSHOptions(sshcert.HostAlias(vmID)))
	require.NoError(t, err, "ssh as the VM's login user with a fresh certificate, by its alias:\n%s\nsshd:\n%s", out, sshdLog)
	assert.Contains(t, out, "in-the-guest")
	assert.Contains(t, sshdLog.String(), "Accepted publickey for "+me.Username, "sshd took the certificate")

	// The guest is root in its VM and holds its host certificate: it
	// passes for no name but its own alias. Not its id or its name (the
	// known_hosts line trusts the host CA for eitri's aliases only), not
	// localhost, not another VM's alias.
	for _, name := range []string{vmID, "web", "localhost", sshcert.HostAlias("vm-another")} {
		out, err := runSSH(l.SSHOptions(name))
		assert.Error(t, err, "the host certificate passes for %s", name)
		assert.Contains(t, out, "Host key verification failed", name)
	}
	// Nor can its owner name a VM so that its alias is theirs.
	_, err = e.eitri("vm", "create", sshcert.HostAlias(vmID), "--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32))
	assert.ErrorContains(t, err, "name: ")

	other := l.SSHOptions(sshcert.HostAlias(vmID))
	other[len(other)-1] = "nobody" // -l: a user the certificate does not name
	out, err = runSSH(other)
	assert.Error(t, err, "a certificate for another principal is refused")
	assert.Contains(t, out, "Permission denied")

	// A certificate its holder got for another VM (the same login user,
	// the same CA) opens nothing here: this is how one tenant's certificate
	// is kept out of another tenant's guest.
	other2, err := e.srv.Fleet.CreateVM(e.adminCtx(), &eitriv1.CreateVMRequest{Name: "web-2", ImageUrl: "http://images.test/g.raw",
		ImageSha256: strings.Repeat("ab", 32), Vcpus: 1, MemMb: 256, DiskGb: 1})
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		v, err := e.srv.Fleet.GetVM(e.adminCtx(), other2.Id)
		return err == nil && v.LoginUser == me.Username
	}, 10*time.Second, 10*time.Millisecond)
	forOther, err := cli.NewSSHLogin(ctx, t.TempDir(), other2.Id, 0)
	require.NoError(t, err)
	t.Cleanup(func() { _ = forOther.Remove() })
	out, err = runSSH(forOther.SSHOptions(sshcert.HostAlias(vmID)))
	assert.Error(t, err, "a certificate for another VM is refused")
	assert.Contains(t, out, "Permission denied")

	expired := login(time.Second)
	for time.Now().Before(expired.ValidBefore.Add(time.Second)) {
		time.Sleep(100 * time.Millisecond)
	}
	out, err = runSSH(expired.SSHOptions(sshcert.HostAlias(vmID)))
	assert.Error(t, err, "an expired certificate is refused")
	assert.Contains(t, out, "Permission denied")
	// sshd's own log of the refusal may land just after the client has
	// seen the connection close.
	assert.Eventually(t, func() bool { return strings.Contains(sshdLog.String(), "expired") }, 5*time.Second, 20*time.Millisecond,
		"sshd says why:\n%s", sshdLog)

	// eitri ssh itself, its ProxyCommand standing in for the tunnel (socat
	// to the loopback sshd). The host reports a key other than the one
	// sshd holds: only the host certificate, checked against the host CA
	// under the alias eitri ssh uses, can vouch for the guest.
	proxy := filepath.Join(t.TempDir(), "eitri-proxy")
	require.NoError(t, os.WriteFile(proxy, []byte(fmt.Sprintf("#!/bin/sh\nexec socat - TCP:127.0.0.1:%d\n", port)), 0o755))
	decoy := hostKey(t)
	scripted.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "running", Phase: "ready", Ip: "10.77.0.9", LoginUser: me.Username, SshHostPubkey: decoy}
	})
	require.Eventually(t, func() bool {
		v, err := e.srv.Fleet.GetVM(e.adminCtx(), vmID)
		return err == nil && v.SshHostPubkey == decoy
	}, 10*time.Second, 10*time.Millisecond)
	var sshOut outputtest.Buffer
	err = execute(ctx, []string{"ssh", vmID, "--", "-o", "BatchMode=yes", "echo", "via-eitri-ssh"}, cli.IO{In: strings.NewReader(""), Out: &sshOut, Err: &sshOut,
		Self: func() (string, error) { return proxy, nil }})
	require.NoError(t, err, "eitri ssh:\n%s\nsshd:\n%s", &sshOut, sshdLog)
	assert.Contains(t, sshOut.String(), "via-eitri-ssh")

	// Without the CA line the decoy pin alone refuses the guest: the
	// certificate above was what let it in.
	cfgDir, err := cli.KnownHostsPath()
	require.NoError(t, err)
	require.NoError(t, cli.RewriteKnownHosts(cfgDir, func(f []string) bool { return f[0] == "@cert-authority" }, nil))
	pinned, err := os.ReadFile(cfgDir)
	require.NoError(t, err)
	args := cli.SSHArgs(cli.SSHTarget{Self: proxy, VMID: vmID, User: me.Username, KnownHosts: cfgDir})
	args = append([]string{"-F", "/dev/null", "-o", "BatchMode=yes"}, args...)
	out2, err := exec.Command("ssh", append(args, "echo", "x")...).CombinedOutput()
	assert.Error(t, err, "known_hosts:\n%s", pinned)
	assert.Contains(t, string(out2), "Host key verification failed")
}
