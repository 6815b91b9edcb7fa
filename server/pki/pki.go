// Package pki gives the control plane a TLS identity without an operator
// having to bring one: on first start it makes its own CA and a serving
// certificate signed by it, and keeps both in the data directory. Agents do
// not trust the CA through any store; they pin the serving certificate's
// fingerprint, which travels inside the join token.
package pki

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// LoadOrCreate returns the serving certificate in dir, making a CA and a
// certificate for hosts (names or IPs, plus localhost and loopback) if there
// is none yet.
func LoadOrCreate(dir string, hosts []string) (tls.Certificate, error) {
	certPath, keyPath := filepath.Join(dir, "server.crt"), filepath.Join(dir, "server.key")
	if c, err := tls.LoadX509KeyPair(certPath, keyPath); err == nil {
		return withLeaf(c)
	} else if !errors.Is(err, os.ErrNotExist) {
		// Never made afresh on its own: agents pin this identity, and a new
		// one would lock every one of them out.
		return tls.Certificate{}, fmt.Errorf("load %s: %w (if it was torn by a crash, restore it, or remove %s to make a new identity that agents must re-enroll with)", certPath, err, dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return tls.Certificate{}, err
	}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "eitri control plane CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.AddDate(10, 0, 0),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return tls.Certificate{}, err
	}
	ca, _ := x509.ParseCertificate(caDER)

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "eitri control plane"},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.AddDate(5, 0, 0),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:     []string{"localhost"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
	}
	if hn, err := os.Hostname(); err == nil {
		tmpl.DNSNames = append(tmpl.DNSNames, hn)
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else if h != "" {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return tls.Certificate{}, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return tls.Certificate{}, err
	}
	caKeyDER, err := x509.MarshalECPrivateKey(caKey)
	if err != nil {
		return tls.Certificate{}, err
	}
	for _, f := range []struct {
		name, typ string
		der       []byte
		mode      os.FileMode
	}{
		{"ca.crt", "CERTIFICATE", caDER, 0o644},
		{"ca.key", "EC PRIVATE KEY", caKeyDER, 0o600},
		// The chain goes with the leaf so a client that wants to verify
		// against the CA can.
		{"server.key", "EC PRIVATE KEY", keyDER, 0o600},
	} {
		if err := WriteDurable(filepath.Join(dir, f.name), f.mode, pemBlock(f.typ, f.der)); err != nil {
			return tls.Certificate{}, err
		}
	}
	chain := append(pemBlock("CERTIFICATE", der), pemBlock("CERTIFICATE", caDER)...)
	if err := WriteDurable(certPath, 0o644, chain); err != nil {
		return tls.Certificate{}, err
	}
	c, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		return tls.Certificate{}, err
	}
	return withLeaf(c)
}

// Load reads an operator-supplied certificate and key.
func Load(certPath, keyPath string) (tls.Certificate, error) {
	c, err := tls.LoadX509KeyPair(certPath, keyPath)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("load --tls-cert/--tls-key: %w", err)
	}
	return withLeaf(c)
}

func withLeaf(c tls.Certificate) (tls.Certificate, error) {
	if c.Leaf == nil {
		leaf, err := x509.ParseCertificate(c.Certificate[0])
		if err != nil {
			return tls.Certificate{}, err
		}
		c.Leaf = leaf
	}
	return c, nil
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 126))
	return n
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

// WriteDurable replaces path with data, durably: the control plane's
// identity is handed out (as a fingerprint in join tokens, as a CA guests
// trust) as soon as it exists, so a power loss must not take it back. The
// file is flushed before the rename and the directory after it, so path is
// either absent or whole.
func WriteDurable(path string, mode os.FileMode, data []byte) (err error) {
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if _, err = f.Write(data); err != nil {
		return err
	}
	if err = fsync(f); err != nil {
		return fmt.Errorf("sync %s: %w", tmp, err)
	}
	if err = f.Close(); err != nil {
		return err
	}
	if err = os.Rename(tmp, path); err != nil {
		return err
	}
	return syncDir(filepath.Dir(path))
}

// fsync is (*os.File).Sync; a test swaps it to see what is synced.
var fsync = (*os.File).Sync

// syncDir makes the entries of dir (a rename into it) durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := fsync(d); err != nil {
		return fmt.Errorf("sync %s: %w", dir, err)
	}
	return nil
}
