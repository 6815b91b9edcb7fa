package main

import (
	"crypto/rand"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/cmd/eitri/cli"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/sshcert"
)

func TestEitriSSHOffersTheCertificateAndTrustsTheHostCA(t *testing.T) {
	l := &cli.SSHLogin{IdentityFile: "/tmp/k/id_ed25519", CertificateFile: "/tmp/k/id_ed25519-cert.pub"}
	args := cli.SSHArgs(cli.SSHTarget{Self: "/bin/eitri", VMID: "vm-1", User: "eitri", KnownHosts: "/kh", Login: l})
	i := slices.Index(args, "-i")
	require.GreaterOrEqual(t, i, 0, "%q", args)
	assert.Equal(t, l.IdentityFile, args[i+1])
	assert.Contains(t, args, "CertificateFile="+l.CertificateFile)
	assert.Less(t, i, slices.Index(args, "eitri-vm-1"), "options come before the destination")
	assert.NotContains(t, cli.SSHArgs(cli.SSHTarget{Self: "/bin/eitri", VMID: "vm-1", KnownHosts: "/kh"}), "-i", "no certificate, no -i")

	kh := filepath.Join(t.TempDir(), "known_hosts")
	key := "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK7Xn3sWZ9Ou5aZPk0jY2rH1d6Jx2Yp5m8Ew3Zb1q4cQ"
	require.NoError(t, cli.PinHostKey(kh, "eitri-vm-1", key))
	require.NoError(t, cli.PinHostCAs(kh, []*eitriv1.SSHCAKey{{PublicKey: key + " old-comment"}}))
	require.NoError(t, cli.PinHostCAs(kh, []*eitriv1.SSHCAKey{{PublicKey: key}}))
	b, err := os.ReadFile(kh)
	require.NoError(t, err)
	assert.Equal(t, "eitri-vm-1 "+key+"\n@cert-authority eitri-* "+key+"\n", string(b),
		"the pinned key stays, the CA line is replaced rather than added again, and trusts the CA for eitri's aliases only")
	assert.Error(t, cli.PinHostCAs(kh, []*eitriv1.SSHCAKey{{PublicKey: "@cert-authority * x\nevil"}}))
}

// Host certificates live a month; a guest cut off from its renewals
// presents a lapsed one. eitri ssh still reaches it by the key it pinned
// (ssh drops a certificate it cannot accept and checks the plain key),
// and a client trusting the host CA alone refuses it. Debian's sshd and
// ssh, on loopback.
func TestEitriSSHReachesAGuestWhoseHostCertificateLapsedByItsPinnedKey(t *testing.T) {
	me := needSSHD(t, "ssh", "socat")
	dir := t.TempDir()
	writeKey := func(name string) (ssh.Signer, string) {
		path := filepath.Join(dir, name)
		return writeSSHKey(t, path), path
	}
	hostSigner, hostKeyPath := writeKey("host_key")
	caSigner, _ := writeKey("host_ca")
	userSigner, userKeyPath := writeKey("id_ed25519")
	const vmID = "vm-lapsed"
	cert := &ssh.Certificate{Key: hostSigner.PublicKey(), CertType: ssh.HostCert, ValidPrincipals: []string{vmID, sshcert.HostAlias(vmID)},
		ValidAfter: uint64(time.Now().Add(-31 * 24 * time.Hour).Unix()), ValidBefore: uint64(time.Now().Add(-time.Hour).Unix())}
	require.NoError(t, cert.SignCert(rand.Reader, caSigner))
	certPath := filepath.Join(dir, "host_key-cert.pub")
	require.NoError(t, os.WriteFile(certPath, ssh.MarshalAuthorizedKey(cert), 0o644))
	authorized := filepath.Join(dir, "authorized_keys")
	require.NoError(t, os.WriteFile(authorized, ssh.MarshalAuthorizedKey(userSigner.PublicKey()), 0o600))

	port, sshdLog := startSSHD(t, hostKeyPath, certPath, "AuthorizedKeysFile "+authorized+"\n")

	// eitri ssh's own known_hosts and command line, its ProxyCommand
	// standing in for the tunnel.
	proxy := filepath.Join(dir, "eitri-proxy")
	require.NoError(t, os.WriteFile(proxy, []byte(fmt.Sprintf("#!/bin/sh\nexec socat - TCP:127.0.0.1:%d\n", port)), 0o755))
	kh := filepath.Join(dir, "known_hosts")
	caKey := []*eitriv1.SSHCAKey{{PublicKey: string(ssh.MarshalAuthorizedKey(caSigner.PublicKey()))}}
	require.NoError(t, cli.PinHostCAs(kh, caKey))
	run := func() (string, error) {
		args := append([]string{"-F", "/dev/null", "-o", "BatchMode=yes", "-i", userKeyPath, "-o", "IdentitiesOnly=yes"},
			cli.SSHArgs(cli.SSHTarget{Self: proxy, VMID: vmID, User: me.Username, KnownHosts: kh})...)
		out, err := exec.Command("ssh", append(args, "echo", "in-the-guest")...).CombinedOutput()
		return string(out), err
	}
	out, err := run()
	assert.Error(t, err, "the host CA alone does not vouch for a lapsed certificate")
	assert.Contains(t, out, "Host key verification failed")

	pub := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(hostSigner.PublicKey())))
	require.NoError(t, cli.PinHostKey(kh, sshcert.HostAlias(vmID), pub))
	out, err = run()
	require.NoError(t, err, "eitri ssh with the reported key pinned:\n%s\nsshd:\n%s", out, sshdLog)
	assert.Contains(t, out, "in-the-guest")
}
