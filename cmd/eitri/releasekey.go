package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/a73x/eitri/wire/release"
)

// releaseKeyFlag is --release-key: a release public key, given as its text
// ("eitri-release-ed25519:…") or as the path of a .pub file holding it.
type releaseKeyFlag struct{ key release.PublicKey }

func (f *releaseKeyFlag) String() string { return f.key.String() }

func (f *releaseKeyFlag) Type() string { return "KEY|FILE" }

func (f *releaseKeyFlag) Set(v string) error {
	text := v
	if !strings.HasPrefix(strings.TrimSpace(v), "eitri-release-") {
		b, err := os.ReadFile(v)
		if err != nil {
			return fmt.Errorf("want a release public key or a file holding one: %w", err)
		}
		text = string(b)
	}
	k, err := release.ParsePublicKey(text)
	if err != nil {
		return err
	}
	f.key = k
	return nil
}

// devReleaseKey is eitri dev's own release key pair, made on its first
// start in its data dir: builds signed with it (eitri release sign --key
// DIR/release.key) upgrade the dev agent.
func devReleaseKey(dir string) (release.PublicKey, error) {
	keyPath := filepath.Join(dir, "release.key")
	b, err := os.ReadFile(keyPath)
	switch {
	case err == nil:
		priv, err := release.ParsePrivateKey(b)
		if err != nil {
			return release.PublicKey{}, fmt.Errorf("%s: %w", keyPath, err)
		}
		return priv.Public(), nil
	case !errors.Is(err, os.ErrNotExist):
		return release.PublicKey{}, err
	}
	pub, priv, err := release.GenerateKey()
	if err != nil {
		return release.PublicKey{}, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return release.PublicKey{}, err
	}
	if err := os.WriteFile(keyPath, release.MarshalPrivateKey(priv), 0o600); err != nil {
		return release.PublicKey{}, err
	}
	if err := os.WriteFile(filepath.Join(dir, "release.pub"), []byte(pub.String()+"\n"), 0o644); err != nil {
		return release.PublicKey{}, err
	}
	return pub, nil
}
