package main

import (
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

// hostKey is a fresh SSH public key in authorized_keys form.
func hostKey(t *testing.T) string {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	k, err := ssh.NewPublicKey(pub)
	require.NoError(t, err)
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k)))
}

// option is the value of ssh's -o name=value in args, and whether it is
// there.
func option(args []string, name string) (string, bool) {
	for i := 0; i+1 < len(args); i++ {
		if args[i] == "-o" {
			if v, ok := strings.CutPrefix(args[i+1], name+"="); ok {
				return v, true
			}
		}
	}
	return "", false
}

func TestSSHArgsGoThroughTheTunnelWithTheHostKeyPinnedStrictly(t *testing.T) {
	args := cli.SSHArgs(cli.SSHTarget{Self: "/opt/my tools/eitri", VMID: "vm-abc", User: "eitri", KnownHosts: "/home/u/.config/eitri/known_hosts",
		Extra: []string{"-v", "uname", "-a"}})
	for name, want := range map[string]string{
		"ProxyCommand":          "'/opt/my tools/eitri' tunnel vm-abc 22",
		"HostKeyAlias":          "eitri-vm-abc",
		"UserKnownHostsFile":    "/home/u/.config/eitri/known_hosts",
		"GlobalKnownHostsFile":  "/dev/null",
		"StrictHostKeyChecking": "yes",
		"UpdateHostKeys":        "no",
	} {
		got, ok := option(args, name)
		assert.True(t, ok, "-o %s is given", name)
		assert.Equal(t, want, got, name)
	}
	assert.Equal(t, []string{"-l", "eitri", "eitri-vm-abc", "-v", "uname", "-a"}, args[len(args)-6:],
		"the login user, the alias as destination, then the caller's arguments")

	got, _ := option(cli.SSHArgs(cli.SSHTarget{Self: "/tmp/100%/eitri", VMID: "vm-1"}), "ProxyCommand")
	assert.Equal(t, "/tmp/100%%/eitri tunnel vm-1 22", got, "ssh's %-tokens are escaped")
	assert.NotContains(t, cli.SSHArgs(cli.SSHTarget{Self: "eitri", VMID: "vm-1"}), "-l", "no login user known: ssh's default")
}

func TestPinHostKeyKeepsOneCanonicalLinePerVM(t *testing.T) {
	path := filepath.Join(t.TempDir(), "eitri", "known_hosts")
	k1, k2, k3 := hostKey(t), hostKey(t), hostKey(t)
	require.NoError(t, cli.PinHostKey(path, "eitri-vm-1", k1+" root@guest"))
	require.NoError(t, cli.PinHostKey(path, "eitri-vm-2", k2))
	require.NoError(t, cli.PinHostKey(path, "eitri-vm-1", k3), "a VM whose key changed (rebuilt) is pinned to its new key")
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	assert.Equal(t, "eitri-vm-2 "+k2+"\neitri-vm-1 "+k3+"\n", string(b), "one line per VM, key only (no comment)")

	injected := k1 + "\n* " + k2
	require.NoError(t, cli.PinHostKey(path, "eitri-vm-3", injected))
	b, err = os.ReadFile(path)
	require.NoError(t, err)
	assert.NotContains(t, string(b), "* ", "a reported key cannot add a line for other hosts")
	assert.Error(t, cli.PinHostKey(path, "eitri-vm-4", "not a key"))

	fi, err := os.Stat(filepath.Dir(path))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o700), fi.Mode().Perm())
}

// eitri ssh, through the API, with a stand-in for the system ssh that
// records its command line.
func TestEitriSSHPinsTheReportedHostKeyAndRunsSSH(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	h := e.connectHost("h1")
	key := hostKey(t)
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.VmId, Power: "running", Phase: "ready", Ip: "10.0.0.5", SshHostPubkey: key, LoginUser: "eitri"}
	})
	bin := t.TempDir()
	record := filepath.Join(t.TempDir(), "args")
	certCopy := filepath.Join(t.TempDir(), "cert")
	// It records its arguments and keeps a copy of the certificate it was
	// given (eitri removes the original once ssh exits).
	require.NoError(t, os.WriteFile(filepath.Join(bin, "ssh"), []byte("#!/bin/sh\nprintf '%s\\n' \"$@\" > "+record+
		"\nfor a; do case \"$a\" in CertificateFile=*) cp \"${a#CertificateFile=}\" "+certCopy+";; esac; done\n"), 0o755))
	t.Setenv("PATH", bin+":"+os.Getenv("PATH"))

	_, err := e.eitri("vm", "create", "web-1", "--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32), "--wait")
	require.NoError(t, err)
	var errOut outputtest.Buffer
	err = execute(context.Background(), []string{"ssh", "web-1", "--", "-v", "uname"}, cli.IO{In: strings.NewReader(""), Out: &errOut, Err: &errOut})
	require.NoError(t, err, errOut.String())

	b, err := os.ReadFile(record)
	require.NoError(t, err)
	args := strings.Split(strings.TrimSpace(string(b)), "\n")
	alias := args[len(args)-3]
	require.True(t, strings.HasPrefix(alias, "eitri-vm-"), "%q", args)
	assert.Equal(t, []string{"-l", "eitri", alias, "-v", "uname"}, args[len(args)-5:])
	strict, _ := option(args, "StrictHostKeyChecking")
	assert.Equal(t, "yes", strict)
	proxy, _ := option(args, "ProxyCommand")
	assert.True(t, strings.HasSuffix(proxy, " tunnel "+strings.TrimPrefix(alias, "eitri-")+" 22"), proxy)
	known, _ := option(args, "UserKnownHostsFile")
	assert.Equal(t, filepath.Join(os.Getenv("XDG_CONFIG_HOME"), "eitri", "known_hosts"), known)
	kh, err := os.ReadFile(known)
	require.NoError(t, err)
	cas, err := e.eitri("ssh-ca", "--known-hosts")
	require.NoError(t, err)
	assert.Equal(t, alias+" "+key+"\n"+cas, string(kh), "the reported key, under the alias ssh checks, and the host CA")

	// A certificate for a key made for this login, as the login user.
	certPath, ok := option(args, "CertificateFile")
	require.True(t, ok, "%q", args)
	assert.Contains(t, args, "-i")
	_, err = os.Stat(certPath)
	assert.True(t, os.IsNotExist(err), "the key and certificate are removed once ssh exits")
	certLine, err := os.ReadFile(certCopy)
	require.NoError(t, err)
	k, _, _, _, err := ssh.ParseAuthorizedKey(certLine)
	require.NoError(t, err)
	cert, ok := k.(*ssh.Certificate)
	require.True(t, ok)
	assert.Equal(t, []string{"eitri@" + strings.TrimPrefix(alias, "eitri-")}, cert.ValidPrincipals, "the login user on this VM")

	_, err = e.eitri("ssh", "web-1", "extra")
	var ue cli.UsageError
	assert.ErrorAs(t, err, &ue, "ssh's arguments go after --")
}
