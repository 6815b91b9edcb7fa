package imagesource

import (
	"bytes"
	"errors"
	"fmt"
	"strings"

	"github.com/ProtonMail/go-crypto/openpgp"
	"github.com/ProtonMail/go-crypto/openpgp/armor"
	pgperrors "github.com/ProtonMail/go-crypto/openpgp/errors"
)

var armorPrefix = []byte("-----BEGIN PGP")

// ReadKeyring parses OpenPGP public keys, armored or binary. A keyring with
// no key, or with a private key in it, is refused: it is stored, shown to
// no one, and a private key has no business on the control plane.
func ReadKeyring(data []byte) (openpgp.EntityList, error) {
	var (
		keys openpgp.EntityList
		err  error
	)
	if bytes.HasPrefix(bytes.TrimSpace(data), armorPrefix) {
		keys, err = openpgp.ReadArmoredKeyRing(bytes.NewReader(data))
	} else {
		keys, err = openpgp.ReadKeyRing(bytes.NewReader(data))
	}
	if err != nil {
		return nil, fmt.Errorf("not an OpenPGP public keyring: %v", err)
	}
	if len(keys) == 0 {
		return nil, errors.New("holds no OpenPGP key")
	}
	for _, k := range keys {
		if k.PrivateKey != nil {
			return nil, errors.New("holds a private key; give only public keys")
		}
	}
	return keys, nil
}

// CheckSignature checks a detached OpenPGP signature (armored or binary)
// over signed against keys, and names the key that made it: its
// fingerprint and first user id.
func CheckSignature(keys openpgp.EntityList, signed, sig []byte) (signer string, err error) {
	var sigReader = bytes.NewReader(sig)
	var e *openpgp.Entity
	if bytes.HasPrefix(bytes.TrimSpace(sig), armorPrefix) {
		block, aerr := armor.Decode(bytes.NewReader(sig))
		if aerr != nil {
			return "", fmt.Errorf("not an OpenPGP signature: %v", aerr)
		}
		e, err = openpgp.CheckDetachedSignature(keys, bytes.NewReader(signed), block.Body, nil)
	} else {
		e, err = openpgp.CheckDetachedSignature(keys, bytes.NewReader(signed), sigReader, nil)
	}
	if errors.Is(err, pgperrors.ErrUnknownIssuer) {
		return "", errors.New("made by a key that is not in the image's keyring")
	}
	if err != nil {
		return "", fmt.Errorf("does not verify: %v", err)
	}
	return describe(e), nil
}

func describe(e *openpgp.Entity) string {
	fp := strings.ToUpper(fmt.Sprintf("%x", e.PrimaryKey.Fingerprint))
	if id := e.PrimaryIdentity(); id != nil && id.Name != "" {
		return fp + " " + id.Name
	}
	return fp
}
