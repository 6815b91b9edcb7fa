package server

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/a73x/eitri/server/pki"
	"github.com/a73x/eitri/server/store"
)

// secrets carries the data dir's files that every replica must hold alike
// to and from the shared database (see store.Secrets): pulled before the
// control plane loads them, so a replica takes what the first one made,
// and pushed after, so what this one made (or rotated) reaches the others.
// On SQLite both are no-ops: the files are the only copy.
type secrets struct {
	st  *store.Store
	dir string
	// tls: the TLS material is the self-made one in the data dir (not
	// operator-given files, which every replica is given alike).
	tls bool
}

func (s secrets) shared(name string) bool {
	_, ok := store.SecretFiles[name]
	return ok && (s.tls || !strings.HasPrefix(name, "tls/"))
}

func (s secrets) pull(ctx context.Context) error {
	if !s.st.Shared() {
		return nil
	}
	all, err := s.st.Secrets(ctx)
	if err != nil {
		return err
	}
	for name, data := range all {
		if !s.shared(name) {
			continue
		}
		path := filepath.Join(s.dir, filepath.FromSlash(name))
		if cur, err := os.ReadFile(path); err == nil && bytes.Equal(cur, data) {
			continue
		}
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return err
		}
		if err := pki.WriteDurable(path, store.SecretFiles[name], data); err != nil {
			return err
		}
	}
	return nil
}

func (s secrets) push(ctx context.Context) error {
	if !s.st.Shared() {
		return nil
	}
	out := map[string][]byte{}
	for name := range store.SecretFiles {
		if !s.shared(name) {
			continue
		}
		data, err := os.ReadFile(filepath.Join(s.dir, filepath.FromSlash(name)))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		out[name] = data
	}
	return s.st.PutSecrets(ctx, out)
}

// warnMissingNames says when this replica's --tls-hosts name something the
// shared certificate (made by the first replica) does not cover: clients
// that verify names rather than pin would refuse it.
func (s secrets) warnMissingNames(cert tls.Certificate, hosts []string, log *slog.Logger) {
	if !s.tls || !s.st.Shared() || cert.Leaf == nil {
		return
	}
	for _, h := range hosts {
		if h == "" {
			continue
		}
		covered := slices.Contains(cert.Leaf.DNSNames, h)
		if ip := net.ParseIP(h); ip != nil {
			covered = slices.ContainsFunc(cert.Leaf.IPAddresses, ip.Equal)
		}
		if !covered {
			log.Warn("the shared serving certificate, made by the first replica, does not name this host; give every replica the same --tls-hosts (all replicas' names and the load balancer's) before the first one starts",
				"host", h)
		}
	}
}
