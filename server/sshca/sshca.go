// Package sshca holds the control plane's two SSH certificate authorities:
// the user CA, whose certificates let a person log into a guest for a few
// minutes, and the host CA, whose certificates vouch for a guest's host key,
// so one "@cert-authority" known_hosts line trusts every eitri guest under
// the alias eitri gives it (wire/sshcert.HostAlias), and no other name. Both
// are ed25519 keys made on first start and kept in the data directory beside
// the TLS material.
//
// Rotation (Rotate) makes a new key and keeps the previous one's public half
// trusted until the next rotation: it stays in Trusted, so new guests' seeds
// and the published known_hosts lines carry both. Certificates are always
// signed by the current key. A guest reads its seed once, on its first boot:
// guests seeded before a user CA rotation trust only the keys their seed
// named, so certificates from the new key are refused there (their injected
// key still works).
package sshca

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/binary"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/server/pki"
	"github.com/a73x/eitri/wire/sshcert"
)

// Kind names one of the two authorities.
type Kind string

const (
	User Kind = "user"
	Host Kind = "host"
)

// Authority is both CAs. Safe for concurrent use.
type Authority struct {
	dir string

	mu   sync.RWMutex
	keys map[Kind]*keyset
}

type keyset struct {
	signer   ssh.Signer
	previous ssh.PublicKey // nil before the first rotation
}

func (k Kind) keyPath(dir string) string { return filepath.Join(dir, string(k)+"_ca") }
func (k Kind) previousPath(dir string) string {
	return filepath.Join(dir, string(k)+"_ca.previous.pub")
}

// LoadOrCreate reads both CAs from dir, making each one that does not exist
// yet. A CA key that exists but cannot be read is an error, never replaced:
// every guest and known_hosts file trusting it would be locked out.
func LoadOrCreate(dir string) (*Authority, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	keys, err := loadBoth(dir, true)
	if err != nil {
		return nil, err
	}
	return &Authority{dir: dir, keys: keys}, nil
}

// loadBoth reads both CAs from dir, making one that does not exist yet if
// orCreate.
func loadBoth(dir string, orCreate bool) (map[Kind]*keyset, error) {
	keys := map[Kind]*keyset{}
	for _, k := range []Kind{User, Host} {
		ks, err := load(dir, k)
		if orCreate && errors.Is(err, os.ErrNotExist) {
			ks, err = create(dir, k)
		}
		if err != nil {
			return nil, fmt.Errorf("ssh %s CA: %w", k, err)
		}
		keys[k] = ks
	}
	return keys, nil
}

func load(dir string, k Kind) (*keyset, error) {
	data, err := os.ReadFile(k.keyPath(dir))
	if err != nil {
		return nil, err
	}
	signer, err := ssh.ParsePrivateKey(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w (restore it, or remove it to make a new CA that every guest and client must be told about)", k.keyPath(dir), err)
	}
	ks := &keyset{signer: signer}
	prev, err := os.ReadFile(k.previousPath(dir))
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return nil, err
	default:
		if ks.previous, _, _, _, err = ssh.ParseAuthorizedKey(prev); err != nil {
			return nil, fmt.Errorf("%s: %w", k.previousPath(dir), err)
		}
		if bytes.Equal(ks.previous.Marshal(), signer.PublicKey().Marshal()) {
			// A rotation cut short after recording the old key as previous
			// and before writing the new one: there is only one key.
			ks.previous = nil
		}
	}
	return ks, nil
}

// create makes a new key for k and writes it durably.
func create(dir string, k Kind) (*keyset, error) {
	signer, pemBytes, err := newKey(k)
	if err != nil {
		return nil, err
	}
	if err := pki.WriteDurable(k.keyPath(dir), 0o600, pemBytes); err != nil {
		return nil, err
	}
	if err := pki.WriteDurable(k.keyPath(dir)+".pub", 0o644, ssh.MarshalAuthorizedKey(signer.PublicKey())); err != nil {
		return nil, err
	}
	return &keyset{signer: signer}, nil
}

func newKey(k Kind) (ssh.Signer, []byte, error) {
	_, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	block, err := ssh.MarshalPrivateKey(priv, "eitri "+string(k)+" CA")
	if err != nil {
		return nil, nil, err
	}
	signer, err := ssh.NewSignerFromKey(priv)
	if err != nil {
		return nil, nil, err
	}
	return signer, pem.EncodeToMemory(block), nil
}

// Rotate replaces k's key with a new one. The old public key is kept as the
// previous key (trusted until the next rotation); an older previous key is
// dropped. The files are written before memory changes, so a crash leaves
// either the old CA or the new one with its predecessor recorded.
func (a *Authority) Rotate(k Kind) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	old, ok := a.keys[k]
	if !ok {
		return fmt.Errorf("no such CA %q", k)
	}
	signer, pemBytes, err := newKey(k)
	if err != nil {
		return err
	}
	if err := pki.WriteDurable(k.previousPath(a.dir), 0o644, ssh.MarshalAuthorizedKey(old.signer.PublicKey())); err != nil {
		return err
	}
	if err := pki.WriteDurable(k.keyPath(a.dir), 0o600, pemBytes); err != nil {
		return err
	}
	if err := pki.WriteDurable(k.keyPath(a.dir)+".pub", 0o644, ssh.MarshalAuthorizedKey(signer.PublicKey())); err != nil {
		return err
	}
	a.keys[k] = &keyset{signer: signer, previous: old.signer.PublicKey()}
	return nil
}

// Reload reads both CAs from the directory again: another replica rotated
// one and the shared files now hold its new key.
func (a *Authority) Reload() error {
	keys, err := loadBoth(a.dir, false)
	if err != nil {
		return err
	}
	a.mu.Lock()
	a.keys = keys
	a.mu.Unlock()
	return nil
}

// PublicKey is k's current key.
func (a *Authority) PublicKey(k Kind) ssh.PublicKey {
	a.mu.RLock()
	defer a.mu.RUnlock()
	return a.keys[k].signer.PublicKey()
}

// Trusted is every key of k that should be trusted: the current one first,
// then the previous one if a rotation kept it.
func (a *Authority) Trusted(k Kind) []ssh.PublicKey {
	a.mu.RLock()
	defer a.mu.RUnlock()
	ks := a.keys[k]
	out := []ssh.PublicKey{ks.signer.PublicKey()}
	if ks.previous != nil {
		out = append(out, ks.previous)
	}
	return out
}

// AuthorizedKey renders a public key as one authorized_keys-style line
// without the newline.
func AuthorizedKey(k ssh.PublicKey) string {
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(k)))
}

// KnownHostsLine is the known_hosts line that trusts the host certificates
// k signs for eitri's host aliases only. "*" would let the host CA vouch
// for any name a certificate carried, so one mistaken principal would be a
// certificate for somebody else's host.
func KnownHostsLine(k ssh.PublicKey) string {
	return "@cert-authority " + sshcert.HostAliasPattern + " " + AuthorizedKey(k)
}

// Validity bounds a certificate.
type Validity struct {
	After, Before time.Time
}

// Sign issues a certificate of kind k (user or host) for pub, valid for
// principals in v, signed by k's current key. principals must not be empty:
// a certificate without principals is valid for every user (or host).
func (a *Authority) Sign(k Kind, pub ssh.PublicKey, keyID string, principals []string, v Validity) (*ssh.Certificate, error) {
	if len(principals) == 0 {
		return nil, errors.New("sshca: a certificate needs at least one principal")
	}
	for _, p := range principals {
		if p == "" {
			return nil, errors.New("sshca: empty principal")
		}
	}
	if !v.Before.After(v.After) {
		return nil, errors.New("sshca: empty validity")
	}
	if _, ok := pub.(*ssh.Certificate); ok {
		return nil, errors.New("sshca: cannot certify a certificate")
	}
	serial, err := Serial()
	if err != nil {
		return nil, err
	}
	cert := &ssh.Certificate{
		Key:             pub,
		Serial:          serial,
		KeyId:           keyID,
		ValidPrincipals: principals,
		ValidAfter:      unix(v.After),
		ValidBefore:     unix(v.Before),
	}
	switch k {
	case User:
		cert.CertType = ssh.UserCert
		// What an interactive session and `ssh -L` need; no X11.
		cert.Permissions.Extensions = map[string]string{
			"permit-pty":              "",
			"permit-port-forwarding":  "",
			"permit-agent-forwarding": "",
			"permit-user-rc":          "",
		}
	case Host:
		cert.CertType = ssh.HostCert
	default:
		return nil, fmt.Errorf("no such CA %q", k)
	}
	a.mu.RLock()
	signer := a.keys[k].signer
	a.mu.RUnlock()
	if err := cert.SignCert(rand.Reader, signer); err != nil {
		return nil, err
	}
	return cert, nil
}

// Serial is a random 63-bit certificate serial: unique in practice (two
// collide after some 3·10⁹ certificates), without a counter that a restore
// from backup could rewind into reuse.
func Serial() (uint64, error) {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return 0, err
	}
	return binary.BigEndian.Uint64(b[:]) >> 1, nil
}

func unix(t time.Time) uint64 {
	if t.Unix() < 0 {
		return 0
	}
	return uint64(t.Unix())
}
