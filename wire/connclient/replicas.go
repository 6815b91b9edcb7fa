package connclient

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"
)

// Replica failover works at the connection, not the request: every
// request names the first URL, and a new connection goes to the replica
// that last took one, else to the next that answers. Nothing is ever sent
// twice (a request body cannot be replayed once a transport has read it),
// and a stream that breaks is re-opened by its caller's own retry, which
// then lands on a live replica.

// Timeouts for reaching one replica before trying the next. A replica that
// accepts TCP but never finishes a handshake (frozen, overloaded) must not
// hold a client for long when another one answers.
var (
	replicaDialTimeout      = 5 * time.Second
	replicaHandshakeTimeout = 10 * time.Second
)

// Replicas returns an HTTP/2 client for one control plane served by several
// replicas at urls, which must share a scheme (all https or all http), and
// the URL requests should name (the first). fingerprint pins the
// certificate every replica presents (they share one serving identity);
// empty with https checks each replica against the system's CAs under its
// own host name; http is h2c.
func Replicas(fingerprint string, urls []string) (*http.Client, string, error) {
	eps, err := parseReplicas(urls)
	if err != nil {
		return nil, "", err
	}
	f := &failover{eps: eps, fingerprint: fingerprint}
	tr := transport()
	if eps[0].tls {
		tr.Protocols.SetHTTP2(true)
		tr.DialTLSContext = f.dialTLS
	} else {
		tr.Protocols.SetUnencryptedHTTP2(true)
		tr.DialContext = f.dial
	}
	return &http.Client{Transport: tr}, urls[0], nil
}

// ParseReplicas checks a list of control-plane URLs as Replicas would.
func ParseReplicas(urls []string) error {
	_, err := parseReplicas(urls)
	return err
}

type replica struct {
	addr, host string // host:port to dial; the name to verify
	tls        bool
}

func parseReplicas(urls []string) ([]replica, error) {
	if len(urls) == 0 {
		return nil, errors.New("no control plane URL")
	}
	eps := make([]replica, 0, len(urls))
	for _, raw := range urls {
		u, err := url.Parse(raw)
		if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
			return nil, fmt.Errorf("%q: want an http:// or https:// URL", raw)
		}
		port := u.Port()
		if port == "" {
			port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
		}
		eps = append(eps, replica{addr: net.JoinHostPort(u.Hostname(), port), host: u.Hostname(), tls: u.Scheme == "https"})
		if eps[len(eps)-1].tls != eps[0].tls {
			return nil, fmt.Errorf("%q: every replica's URL must use the same scheme as %q", raw, urls[0])
		}
	}
	return eps, nil
}

type failover struct {
	eps         []replica
	fingerprint string
	last        atomic.Int32 // index of the replica that last took a connection
}

// each tries connect on every replica, from the last good one on, and
// returns the first connection made.
func (f *failover) each(ctx context.Context, connect func(ctx context.Context, ep replica) (net.Conn, error)) (net.Conn, error) {
	start := int(f.last.Load())
	var errs []error
	for i := range f.eps {
		n := (start + i) % len(f.eps)
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		c, err := connect(ctx, f.eps[n])
		if err == nil {
			f.last.Store(int32(n))
			return c, nil
		}
		errs = append(errs, fmt.Errorf("%s: %w", f.eps[n].addr, err))
	}
	return nil, fmt.Errorf("no control plane replica answered: %w", errors.Join(errs...))
}

func (f *failover) dial(ctx context.Context, _, _ string) (net.Conn, error) {
	return f.each(ctx, dialTCP)
}

func dialTCP(ctx context.Context, ep replica) (net.Conn, error) {
	d := net.Dialer{Timeout: replicaDialTimeout, KeepAlive: 30 * time.Second}
	return d.DialContext(ctx, "tcp", ep.addr)
}

func (f *failover) dialTLS(ctx context.Context, _, _ string) (net.Conn, error) {
	return f.each(ctx, func(ctx context.Context, ep replica) (net.Conn, error) {
		var cfg *tls.Config
		if f.fingerprint != "" {
			cfg = pinned(f.fingerprint)
		} else {
			cfg = &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"h2"}}
		}
		cfg.ServerName = ep.host
		raw, err := dialTCP(ctx, ep)
		if err != nil {
			return nil, err
		}
		hctx, cancel := context.WithTimeout(ctx, replicaHandshakeTimeout)
		defer cancel()
		c := tls.Client(raw, cfg)
		if err := c.HandshakeContext(hctx); err != nil {
			raw.Close()
			return nil, err
		}
		return c, nil
	})
}

// SplitURLs reads a comma-separated list of control-plane URLs, as flags
// and environment variables give them.
func SplitURLs(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}
