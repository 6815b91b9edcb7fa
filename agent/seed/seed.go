// Package seed writes cloud-init NoCloud seed images: an ISO9660 volume
// labelled "cidata" holding meta-data and user-data, which cloud-init (and the
// project's own test guest) finds on a second disk at boot.
package seed

import (
	"bytes"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/kdomanski/iso9660"
	"golang.org/x/crypto/ssh"
)

// VolumeID is the label cloud-init's NoCloud datasource looks for.
const VolumeID = "cidata"

// Params is what one guest learns from its seed.
type Params struct {
	// InstanceID changes whenever cloud-init should treat the guest as new.
	InstanceID string
	// Hostname must be a single DNS label.
	Hostname string
	// SSHAuthorizedKey is one authorized_keys line; empty means none.
	SSHAuthorizedKey string
	// HostPrivKey and HostPubKey are the guest's ed25519 SSH host key pair in
	// OpenSSH format. Both or neither: the agent generates them so it can tell
	// users the fingerprint before the guest has even booted.
	HostPrivKey string
	HostPubKey  string
}

// ErrInvalidParams wraps every validation failure, so callers can treat a bad
// seed request as permanent rather than retrying it.
var ErrInvalidParams = errors.New("invalid seed parameters")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidParams, fmt.Sprintf(format, args...))
}

// Validate reports whether p can be turned into a seed the guest will read
// the way it was meant.
func (p Params) Validate() error {
	if p.InstanceID == "" {
		return invalid("instance id is empty")
	}
	if hasControl(p.InstanceID) {
		return invalid("instance id contains control characters")
	}
	if err := validLabel(p.Hostname); err != nil {
		return err
	}
	if p.SSHAuthorizedKey != "" {
		if hasControl(p.SSHAuthorizedKey) {
			return invalid("authorized key must be one line without control characters")
		}
		if _, _, _, _, err := ssh.ParseAuthorizedKey([]byte(p.SSHAuthorizedKey)); err != nil {
			return invalid("authorized key: %v", err)
		}
	}
	switch {
	case p.HostPrivKey == "" && p.HostPubKey == "":
		return nil
	case p.HostPrivKey == "" || p.HostPubKey == "":
		return invalid("host key needs both the private and the public half")
	}
	return validHostKey(p.HostPrivKey, p.HostPubKey)
}

// validLabel accepts an RFC 1123 label: what a guest can set as its hostname
// without surprises.
func validLabel(h string) error {
	if h == "" {
		return invalid("hostname is empty")
	}
	if len(h) > 63 {
		return invalid("hostname %q is longer than 63 characters", h)
	}
	if h[0] == '-' || h[len(h)-1] == '-' {
		return invalid("hostname %q starts or ends with a hyphen", h)
	}
	for _, c := range []byte(h) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-'
		if !ok {
			return invalid("hostname %q: only letters, digits and hyphens are allowed", h)
		}
	}
	return nil
}

// validHostKey checks the pair is ed25519 and belongs together: a mismatched
// pair would boot fine and then fail every host-key check a client makes.
func validHostKey(priv, pub string) error {
	if hasControl(pub) {
		return invalid("host public key must be one line without control characters")
	}
	for _, r := range priv {
		if r != '\n' && (r < 0x20 || r == 0x7f) {
			return invalid("host private key contains control characters")
		}
	}
	raw, err := ssh.ParseRawPrivateKey([]byte(priv))
	if err != nil {
		return invalid("host private key: %v", err)
	}
	var edPriv ed25519.PrivateKey
	switch k := raw.(type) {
	case ed25519.PrivateKey:
		edPriv = k
	case *ed25519.PrivateKey:
		edPriv = *k
	default:
		return invalid("host private key is %T, want ed25519", raw)
	}
	pk, _, _, _, err := ssh.ParseAuthorizedKey([]byte(pub))
	if err != nil {
		return invalid("host public key: %v", err)
	}
	if pk.Type() != ssh.KeyAlgoED25519 {
		return invalid("host public key is %s, want %s", pk.Type(), ssh.KeyAlgoED25519)
	}
	derived, err := ssh.NewPublicKey(edPriv.Public())
	if err != nil {
		return invalid("host private key: %v", err)
	}
	if !bytes.Equal(derived.Marshal(), pk.Marshal()) {
		return invalid("host public key does not match the private key")
	}
	return nil
}

func hasControl(s string) bool {
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return true
		}
	}
	return false
}

// Write builds the seed ISO for p at outPath. The file appears whole or not at
// all: a half-written seed found after a crash would boot a guest with no
// identity.
func Write(outPath string, p Params) error {
	if err := p.Validate(); err != nil {
		return err
	}
	iw, err := iso9660.NewWriter()
	if err != nil {
		return fmt.Errorf("seed: staging: %w", err)
	}
	defer iw.Cleanup()

	if err := iw.AddFile(strings.NewReader(MetaData(p)), "meta-data"); err != nil {
		return fmt.Errorf("seed: add meta-data: %w", err)
	}
	if err := iw.AddFile(strings.NewReader(UserData(p)), "user-data"); err != nil {
		return fmt.Errorf("seed: add user-data: %w", err)
	}

	dir := filepath.Dir(outPath)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(outPath)+".tmp-*")
	if err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if err := iw.WriteTo(tmp, VolumeID); err != nil {
		return fmt.Errorf("seed: write iso: %w", err)
	}
	// The seed carries a private host key: readable by the agent (and QEMU
	// running as the same user) only.
	if err := tmp.Chmod(0o600); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("seed: sync: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("seed: close: %w", err)
	}
	if err := os.Rename(tmp.Name(), outPath); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	committed = true
	if d, err := os.Open(dir); err == nil {
		// Make the rename itself durable; best effort, the file is complete.
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// MetaData renders the NoCloud meta-data document for p. p must be valid.
func MetaData(p Params) string {
	var b strings.Builder
	b.WriteString("instance-id: " + quote(p.InstanceID) + "\n")
	b.WriteString("local-hostname: " + quote(p.Hostname) + "\n")
	return b.String()
}

// UserData renders the #cloud-config document for p. p must be valid.
func UserData(p Params) string {
	var b strings.Builder
	b.WriteString("#cloud-config\n")
	b.WriteString("hostname: " + quote(p.Hostname) + "\n")
	if p.SSHAuthorizedKey != "" {
		b.WriteString("ssh_authorized_keys:\n")
		b.WriteString("  - " + quote(strings.TrimSpace(p.SSHAuthorizedKey)) + "\n")
	}
	// Deleting the image's own host keys leaves only the agent's, so the
	// fingerprint the agent reported is the one clients will see.
	b.WriteString("ssh_deletekeys: true\n")
	if p.HostPrivKey != "" {
		b.WriteString("ssh_keys:\n")
		b.WriteString("  ed25519_private: |\n")
		for _, line := range strings.Split(strings.TrimRight(p.HostPrivKey, "\n"), "\n") {
			if strings.TrimSpace(line) == "" {
				b.WriteString("\n")
				continue
			}
			b.WriteString("    " + strings.TrimSpace(line) + "\n")
		}
		b.WriteString("  ed25519_public: " + quote(strings.TrimSpace(p.HostPubKey)) + "\n")
	}
	return b.String()
}

// quote renders s as a YAML double-quoted scalar. JSON string syntax is a
// subset of YAML's double-quoted style, and quoting always keeps values such
// as "on", "null" or "0123" strings.
func quote(s string) string {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // encoding a string cannot fail
	return strings.TrimSuffix(buf.String(), "\n")
}
