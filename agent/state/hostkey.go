package state

import (
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"fmt"
	"strings"

	"golang.org/x/crypto/ssh"
)

// NewHostKey generates an ed25519 SSH host key pair for a guest: the public
// half in authorized_keys form (no trailing newline), the private half as an
// OpenSSH PEM block, the format sshd reads from /etc/ssh.
func NewHostKey() (pub, priv string, err error) {
	pk, sk, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return "", "", fmt.Errorf("state: generate host key: %w", err)
	}
	block, err := ssh.MarshalPrivateKey(sk, "")
	if err != nil {
		return "", "", fmt.Errorf("state: encode host key: %w", err)
	}
	sshPub, err := ssh.NewPublicKey(pk)
	if err != nil {
		return "", "", fmt.Errorf("state: encode host key: %w", err)
	}
	pub = strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sshPub)))
	return pub, string(pem.EncodeToMemory(block)), nil
}
