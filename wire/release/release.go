// Package release is what a signed agent build is: the release key pair
// (ed25519) that vouches for builds, and the signature over one build's
// version, platform, size and sha256. The CLI signs with it, the control
// plane checks uploads with it, and the agent checks a download with it
// before it runs anything. The private key never needs to be on a control
// plane; the agent trusts only the public key it learned at enrollment.
//
// A signature carries no expiry on purpose: a build that was good when it
// was signed stays runnable, so an old clock or a lapsed date can never stop
// an agent from starting.
package release

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
)

// publicPrefix starts a public key's text form, so a pasted key says what
// it is.
const publicPrefix = "eitri-release-ed25519:"

// privateBlock is the PEM block type of a private key file.
const privateBlock = "EITRI RELEASE PRIVATE KEY"

// PublicKey checks signatures.
type PublicKey struct{ k ed25519.PublicKey }

// PrivateKey makes signatures.
type PrivateKey struct{ k ed25519.PrivateKey }

// GenerateKey makes a new release key pair.
func GenerateKey() (PublicKey, PrivateKey, error) {
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return PublicKey{}, PrivateKey{}, err
	}
	return PublicKey{pub}, PrivateKey{priv}, nil
}

// Public is the key that checks what k signs.
func (k PrivateKey) Public() PublicKey { return PublicKey{k.k.Public().(ed25519.PublicKey)} }

// IsZero reports a key that was never set.
func (k PublicKey) IsZero() bool { return len(k.k) == 0 }

// String is the key's one-line text form ("eitri-release-ed25519:…"): what
// a join token, --release-key and a .pub file carry.
func (k PublicKey) String() string {
	if k.IsZero() {
		return ""
	}
	return publicPrefix + base64.RawURLEncoding.EncodeToString(k.k)
}

// ID names the key in listings and signatures: short enough to read, long
// enough that two keys never share one by accident.
func (k PublicKey) ID() string {
	sum := sha256.Sum256(k.k)
	return "ed25519:" + hex.EncodeToString(sum[:8])
}

// Equal reports the same key.
func (k PublicKey) Equal(o PublicKey) bool { return bytes.Equal(k.k, o.k) }

// ParsePublicKey reads a key's text form; surrounding space is forgiven, so
// the content of a .pub file parses as it is.
func ParsePublicKey(s string) (PublicKey, error) {
	raw, ok := strings.CutPrefix(strings.TrimSpace(s), publicPrefix)
	if !ok {
		return PublicKey{}, errors.New("not an eitri release public key (it starts with " + publicPrefix + ")")
	}
	b, err := base64.RawURLEncoding.DecodeString(raw)
	if err != nil || len(b) != ed25519.PublicKeySize {
		return PublicKey{}, errors.New("release public key is damaged; copy it again")
	}
	return PublicKey{ed25519.PublicKey(b)}, nil
}

// MarshalPrivateKey is a private key file's content (PEM).
func MarshalPrivateKey(k PrivateKey) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: privateBlock, Bytes: k.k.Seed()})
}

// ParsePrivateKey reads a private key file's content.
func ParsePrivateKey(b []byte) (PrivateKey, error) {
	blk, _ := pem.Decode(b)
	if blk == nil || blk.Type != privateBlock || len(blk.Bytes) != ed25519.SeedSize {
		return PrivateKey{}, errors.New("not an eitri release private key")
	}
	return PrivateKey{ed25519.NewKeyFromSeed(blk.Bytes)}, nil
}

// Build is what a signature vouches for: one binary, by its content, and
// what it claims to be.
type Build struct {
	Version string `json:"version"`
	OS      string `json:"os"`
	Arch    string `json:"arch"`
	// SHA256 is lowercase hex.
	SHA256 string `json:"sha256"`
	Size   int64  `json:"size"`
}

var (
	hexDigest = regexp.MustCompile(`^[0-9a-f]{64}$`)
	// word is what a version, an OS or an architecture may be spelled
	// with: nothing that could blur the line between two fields.
	word = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$`)
)

// Check reports a build no signature may be made or believed for.
func (b Build) Check() error {
	switch {
	case !word.MatchString(b.Version):
		return fmt.Errorf("version %q: want letters, digits and . _ + - (at most 64)", b.Version)
	case !word.MatchString(b.OS) || !word.MatchString(b.Arch):
		return fmt.Errorf("platform %q/%q: want a GOOS and a GOARCH", b.OS, b.Arch)
	case !hexDigest.MatchString(b.SHA256):
		return fmt.Errorf("sha256 %q: want 64 lowercase hex characters", b.SHA256)
	case b.Size <= 0:
		return fmt.Errorf("size %d: a build has bytes", b.Size)
	}
	return nil
}

// Platform is "os/arch".
func (b Build) Platform() string { return b.OS + "/" + b.Arch }

// message is the exact bytes a key signs for b. The context string keeps a
// release signature from being mistaken for any other ed25519 signature.
func (b Build) message() []byte {
	return []byte(strings.Join([]string{"eitri release build v1", b.Version, b.OS, b.Arch, b.SHA256, strconv.FormatInt(b.Size, 10)}, "\n"))
}

// Signature is one signed build: a signature file's content.
type Signature struct {
	Build
	// KeyID is the signer (PublicKey.ID).
	KeyID string `json:"key_id"`
	Sig   []byte `json:"signature"`
}

// Sign vouches for b with k.
func Sign(k PrivateKey, b Build) (Signature, error) {
	if err := b.Check(); err != nil {
		return Signature{}, err
	}
	return Signature{Build: b, KeyID: k.Public().ID(), Sig: ed25519.Sign(k.k, b.message())}, nil
}

// Marshal is a signature file's content.
func (s Signature) Marshal() []byte {
	b, _ := json.MarshalIndent(s, "", "  ") // plain strings and bytes always marshal
	return append(b, '\n')
}

// ParseSignature reads a signature file's content.
func ParseSignature(b []byte) (Signature, error) {
	var s Signature
	if err := json.Unmarshal(b, &s); err != nil {
		return Signature{}, fmt.Errorf("not an eitri release signature: %w", err)
	}
	if err := s.Build.Check(); err != nil {
		return Signature{}, fmt.Errorf("release signature: %w", err)
	}
	if len(s.Sig) != ed25519.SignatureSize {
		return Signature{}, errors.New("release signature: no signature in it")
	}
	return s, nil
}

// ErrUntrusted is a signature no trusted key made, or one that does not
// match what it claims to sign.
var ErrUntrusted = errors.New("release signature does not verify")

// Verify checks that k signed s. It says which key signed instead when it
// was another one, so an operator can tell a foreign build from a damaged
// one.
func (k PublicKey) Verify(s Signature) error {
	if k.IsZero() {
		return fmt.Errorf("%w: no release key is trusted here", ErrUntrusted)
	}
	if err := s.Build.Check(); err != nil {
		return fmt.Errorf("%w: %v", ErrUntrusted, err)
	}
	if s.KeyID != "" && s.KeyID != k.ID() {
		return fmt.Errorf("%w: signed by %s, and only %s is trusted", ErrUntrusted, s.KeyID, k.ID())
	}
	if !ed25519.Verify(k.k, s.message(), s.Sig) {
		return fmt.Errorf("%w: not signed by %s, or altered after signing", ErrUntrusted, k.ID())
	}
	return nil
}

// Digest is a build's content as a signature names it.
type Digest struct {
	SHA256 string
	Size   int64
}

// Sum reads r to its end and returns its digest.
func Sum(r io.Reader) (Digest, error) {
	h := sha256.New()
	n, err := io.Copy(h, r)
	if err != nil {
		return Digest{}, err
	}
	return Digest{SHA256: hex.EncodeToString(h.Sum(nil)), Size: n}, nil
}

// SumFile is Sum of a file's content.
func SumFile(path string) (Digest, error) {
	f, err := os.Open(path)
	if err != nil {
		return Digest{}, err
	}
	defer f.Close()
	return Sum(f)
}

// Matches reports why content with digest d is not the build s signs, or
// nil when it is.
func (s Signature) Matches(d Digest) error {
	if d.Size != s.Size {
		return fmt.Errorf("%w: the build is %d bytes, the signature is for %d", ErrUntrusted, d.Size, s.Size)
	}
	if d.SHA256 != s.SHA256 {
		return fmt.Errorf("%w: the build's sha256 is %s, the signature is for %s", ErrUntrusted, d.SHA256, s.SHA256)
	}
	return nil
}

// VerifyFile checks that path holds exactly the build s signs and that k
// signed it: the check an agent makes before it runs a download.
func (k PublicKey) VerifyFile(s Signature, path string) error {
	if err := k.Verify(s); err != nil {
		return err
	}
	d, err := SumFile(path)
	if err != nil {
		return err
	}
	return s.Matches(d)
}
