// Package imagesource resolves a catalogue image's digest from where its
// distribution publishes it: a SHA256SUMS or SHA512SUMS file, optionally
// signed with a detached OpenPGP signature by a key pinned for the image.
//
// Hosts verify every image download by sha256. A SHA512SUMS names a sha512,
// so the control plane downloads the image once and hashes it both ways:
// the sha512 is checked against the SUMS entry (as a sha256 would be), and
// the sha256 of the same bytes is what hosts are told to verify. One pass
// on the control plane keeps the agent's cache (keyed, verified and resumed
// by sha256) as it is, and proves at add time that the bytes served match
// what the distribution signed, so a broken mirror fails the add, not every
// create after it.
package imagesource

import (
	"context"
	"errors"
	"net/url"
	"path"
	"time"
)

// Source is where an image's digest comes from.
type Source struct {
	URL          string
	SumsURL      string
	SignatureURL string
	// FileName is the name the SUMS file lists the image under; "" for
	// the URL's last path segment.
	FileName string
	// Keyring holds the OpenPGP public keys the signature must be made by.
	Keyring []byte
}

// Resolved is what a Source said, checked.
type Resolved struct {
	SHA256, SHA512 string // SHA512 only when the SUMS file gave one
	Size           int64
	// Signer names the key that signed the SUMS file; "" when unsigned.
	Signer     string
	VerifiedAt time.Time
}

// fileName is the name a SUMS file is searched for: s.FileName, or the
// URL's last path segment.
func (s Source) fileName() string {
	if s.FileName != "" {
		return s.FileName
	}
	u, err := url.Parse(s.URL)
	if err != nil {
		return ""
	}
	return path.Base(u.Path)
}

// CheckKeyring says what is wrong with a keyring, for the add to refuse it
// before fetching anything.
func CheckKeyring(data []byte) error {
	if len(data) > MaxKeyringBytes {
		return &FieldError{Field: "keyring", Err: errors.New("larger than a keyring of a few keys can be")}
	}
	if _, err := ReadKeyring(data); err != nil {
		return &FieldError{Field: "keyring", Err: err}
	}
	return nil
}

// Resolve fetches the SUMS file (and its signature, checked against the
// keyring), finds the image's entry, downloads the image and checks its
// bytes against it.
func (f Fetcher) Resolve(ctx context.Context, s Source, now time.Time) (Resolved, error) {
	name := s.fileName()
	if name == "" || name == "/" || name == "." {
		return Resolved{}, fieldErr("sums_file_name", "the URL names no file to look for in the SUMS file; give sums_file_name")
	}
	sums, err := f.Small(ctx, "sums_url", s.SumsURL, MaxSumsBytes)
	if err != nil {
		return Resolved{}, err
	}
	var out Resolved
	if s.SignatureURL != "" {
		keys, err := ReadKeyring(s.Keyring)
		if err != nil {
			return Resolved{}, &FieldError{Field: "keyring", Err: err}
		}
		sig, err := f.Small(ctx, "sums_signature_url", s.SignatureURL, MaxSignatureBytes)
		if err != nil {
			return Resolved{}, err
		}
		if out.Signer, err = CheckSignature(keys, sums, sig); err != nil {
			return Resolved{}, &FieldError{Field: "sums_signature_url", Err: err}
		}
	}
	want, err := ParseSums(sums, name)
	if err != nil {
		return Resolved{}, &FieldError{Field: "sums_url", Err: err}
	}
	got, err := f.Hash(ctx, "url", s.URL)
	if err != nil {
		return Resolved{}, err
	}
	have := got.SHA256
	if want.Algorithm == SHA512 {
		have = got.SHA512
		out.SHA512 = got.SHA512
	}
	if have != want.Hex {
		return Resolved{}, fieldErr("url", "the image as served (%d bytes) has %s %s, but the SUMS file lists %s for %q",
			got.Size, want.Algorithm, have, want.Hex, name)
	}
	out.SHA256, out.Size, out.VerifiedAt = got.SHA256, got.Size, now
	return out, nil
}
