package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/a73x/eitri/wire/connclient"
)

// defaultURL is eitri dev's address: with no login and no EITRI_URL, the
// client commands talk to a dev instance on this machine.
const defaultURL = "http://127.0.0.1:8080"

// endpoint is a control plane and the credential presented to it.
type endpoint struct {
	URL   string `json:"url"`
	Token string `json:"token"`
	// Fingerprint pins the control plane's certificate (SHA-256 of its DER,
	// hex) for https; empty trusts the system's CAs instead.
	Fingerprint string `json:"fingerprint,omitempty"`
	// Replicas is every URL of a control plane with several replicas, URL
	// first; requests fail over between them. Absent for one URL.
	Replicas []string `json:"replicas,omitempty"`
}

// urls is every URL ep answers at, the first the one requests name.
func (ep endpoint) urls() []string {
	if len(ep.Replicas) > 0 {
		return ep.Replicas
	}
	return []string{ep.URL}
}

// parseURLs reads one URL or a comma-separated list of a control plane's
// replicas, checked and normalized, into ep's URL and Replicas.
func parseURLs(raw string) (endpoint, error) {
	var ep endpoint
	for _, r := range connclient.SplitURLs(raw) {
		u, err := normalizeURL(r)
		if err != nil {
			return endpoint{}, err
		}
		ep.Replicas = append(ep.Replicas, u)
	}
	if len(ep.Replicas) == 0 {
		return endpoint{}, fmt.Errorf("%q: want an http:// or https:// URL", raw)
	}
	if err := connclient.ParseReplicas(ep.Replicas); err != nil {
		return endpoint{}, err
	}
	ep.URL = ep.Replicas[0]
	if len(ep.Replicas) == 1 {
		ep.Replicas = nil
	}
	return ep, nil
}

// configPath is where eitri login saves the endpoint: the user's config
// dir (XDG_CONFIG_HOME, else ~/.config), eitri/config.json.
func configPath() (string, error) {
	dir, err := os.UserConfigDir()
	if err != nil {
		return "", fmt.Errorf("no config dir to keep the login in: %w", err)
	}
	return filepath.Join(dir, "eitri", "config.json"), nil
}

// loadLogin reads the saved endpoint; ok is false when there is none. A
// file others may read is refused, as ssh refuses a key: the token in it
// acts as its user.
func loadLogin() (ep endpoint, path string, ok bool, err error) {
	path, err = configPath()
	if err != nil {
		return endpoint{}, "", false, err
	}
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) {
		return endpoint{}, path, false, nil
	}
	if err != nil {
		return endpoint{}, path, false, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return endpoint{}, path, false, err
	}
	if st.Mode().Perm()&0o077 != 0 {
		return endpoint{}, path, false, fmt.Errorf("%s holds a token but others may read it (mode %04o): chmod 600 it, or run eitri login again", path, st.Mode().Perm())
	}
	if err := json.NewDecoder(f).Decode(&ep); err != nil {
		return endpoint{}, path, false, fmt.Errorf("%s: %w (eitri login writes it anew)", path, err)
	}
	return ep, path, ep.URL != "", nil
}

// saveLogin writes ep where loadLogin reads it: the directory 0700, the
// file 0600 from its first byte (written beside and renamed into place, so
// a reader never sees half a file).
func saveLogin(ep endpoint) (string, error) {
	path, err := configPath()
	if err != nil {
		return "", err
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	// MkdirAll leaves an existing directory as it was.
	if err := os.Chmod(dir, 0o700); err != nil {
		return "", err
	}
	b, err := json.MarshalIndent(ep, "", "  ")
	if err != nil {
		return "", err
	}
	tmp, err := os.CreateTemp(dir, ".config-*.json") // mode 0600
	if err != nil {
		return "", err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(append(b, '\n')); err != nil {
		tmp.Close()
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	return path, os.Rename(tmp.Name(), path)
}

// resolveEndpoint is where a client command goes: the saved login, with
// EITRI_URL, EITRI_TOKEN and EITRI_FINGERPRINT over it. A saved token and
// pin belong to the saved URL only: when EITRI_URL names another control
// plane, they are not sent there.
func resolveEndpoint() (endpoint, error) {
	env := endpoint{URL: os.Getenv("EITRI_URL"), Token: os.Getenv("EITRI_TOKEN"), Fingerprint: os.Getenv("EITRI_FINGERPRINT")}
	ep := endpoint{URL: defaultURL}
	// With both set from the environment, the file is not needed; a broken
	// one does not stop a script that never used it.
	if env.URL == "" || env.Token == "" {
		saved, _, ok, err := loadLogin()
		if err != nil {
			return endpoint{}, err
		}
		if ok {
			ep = saved
		}
	}
	if env.URL != "" {
		given, err := parseURLs(env.URL)
		if err != nil {
			return endpoint{}, fmt.Errorf("EITRI_URL: %w", err)
		}
		if !slices.Equal(given.urls(), ep.urls()) {
			ep = given
		}
	}
	if env.Token != "" {
		ep.Token = env.Token
	}
	if env.Fingerprint != "" {
		ep.Fingerprint = strings.ToLower(env.Fingerprint)
	}
	if ep.Token == "" {
		u := strings.Join(ep.urls(), ",")
		return endpoint{}, fmt.Errorf("no token for %s: run 'eitri login %s', or set EITRI_TOKEN (the first admin's token is in <data-dir>/admin.token)", u, u)
	}
	return ep, nil
}

// normalizeURL checks a control plane's URL and drops what would make two
// spellings of it differ (a trailing slash).
func normalizeURL(raw string) (string, error) {
	u, err := url.Parse(strings.TrimSpace(raw))
	if err != nil {
		return "", err
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", fmt.Errorf("%q: want an http:// or https:// URL", raw)
	}
	if u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
		return "", fmt.Errorf("%q: want scheme://host[:port], nothing more", raw)
	}
	u.Path = strings.TrimRight(u.Path, "/")
	return u.String(), nil
}
