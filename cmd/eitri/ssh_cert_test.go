package main

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestEitriSSHOffersTheCertificateAndTrustsTheHostCA(t *testing.T) {
	l := &sshLogin{IdentityFile: "/tmp/k/id_ed25519", CertificateFile: "/tmp/k/id_ed25519-cert.pub"}
	args := sshArgs(sshTarget{Self: "/bin/eitri", VMID: "vm-1", User: "eitri", KnownHosts: "/kh", Login: l})
	i := slices.Index(args, "-i")
	require.GreaterOrEqual(t, i, 0, "%q", args)
	assert.Equal(t, l.IdentityFile, args[i+1])
	assert.Contains(t, args, "CertificateFile="+l.CertificateFile)
	assert.Less(t, i, slices.Index(args, "eitri-vm-1"), "options come before the destination")
	assert.NotContains(t, sshArgs(sshTarget{Self: "/bin/eitri", VMID: "vm-1", KnownHosts: "/kh"}), "-i", "no certificate, no -i")

	kh := filepath.Join(t.TempDir(), "known_hosts")
	key := "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIK7Xn3sWZ9Ou5aZPk0jY2rH1d6Jx2Yp5m8Ew3Zb1q4cQ"
	require.NoError(t, pinHostKey(kh, "eitri-vm-1", key))
	require.NoError(t, pinHostCAs(kh, []*eitriv1.SSHCAKey{{PublicKey: key + " old-comment"}}))
	require.NoError(t, pinHostCAs(kh, []*eitriv1.SSHCAKey{{PublicKey: key}}))
	b, err := os.ReadFile(kh)
	require.NoError(t, err)
	assert.Equal(t, "eitri-vm-1 "+key+"\n@cert-authority * "+key+"\n", string(b),
		"the pinned key stays, the CA line is replaced rather than added again")
	assert.Error(t, pinHostCAs(kh, []*eitriv1.SSHCAKey{{PublicKey: "@cert-authority * x\nevil"}}))
}
