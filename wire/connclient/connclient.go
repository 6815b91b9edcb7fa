// Package connclient is how every client reaches the control plane: an
// HTTP/2 client pinned to the certificate fingerprint a join token or login
// carried (the pin is the trust anchor, not a CA store), and the interceptor
// that presents a bearer secret. The agent, the CLI and the tests share it so
// a client cannot drift from what the server expects.
package connclient

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"connectrpc.com/connect"
)

// HTTPClient returns a client that speaks HTTP/2 to the control plane: TLS
// pinned to fingerprint (hex SHA-256 of the certificate), or h2c when
// fingerprint is empty.
func HTTPClient(fingerprint string) *http.Client {
	tr := transport()
	tr.DialContext = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	if fingerprint == "" {
		tr.Protocols.SetUnencryptedHTTP2(true)
	} else {
		tr.Protocols.SetHTTP2(true)
		tr.TLSClientConfig = pinned(fingerprint)
	}
	return &http.Client{Transport: tr}
}

// transport is the HTTP/2 transport every client of the control plane
// starts from; the caller sets how it dials and which protocol it speaks.
func transport() *http.Transport {
	return &http.Transport{
		Proxy:             nil, // the control plane is dialed directly, never via a proxy
		ForceAttemptHTTP2: true,
		Protocols:         new(http.Protocols),
		// The control plane may be silent for long (snapshots and watch
		// events go out on change only); a ping on an idle connection tells a
		// dead path from a quiet one, so a stream is retried instead of
		// waiting on TCP.
		HTTP2: &http.HTTP2Config{SendPingTimeout: 10 * time.Second, PingTimeout: 10 * time.Second},
	}
}

// Fingerprint is the pin: the hex SHA-256 of a certificate's DER bytes. The
// server logs and hands it out (join tokens, login) by this rule and every
// client checks it by the same one.
func Fingerprint(der []byte) string {
	sum := sha256.Sum256(der)
	return hex.EncodeToString(sum[:])
}

// pinned trusts exactly the certificate with this fingerprint.
func pinned(fp string) *tls.Config {
	return &tls.Config{
		MinVersion:         tls.VersionTLS12,
		NextProtos:         []string{"h2"},
		InsecureSkipVerify: true, // replaced by the pin below
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			if len(raw) == 0 {
				return errors.New("control plane presented no certificate")
			}
			if got := Fingerprint(raw[0]); got != fp {
				return fmt.Errorf("control plane certificate %s does not match the pinned %s (wrong server, or its certificate changed)", got, fp)
			}
			return nil
		},
	}
}

// Bearer is a client interceptor that sends token as
// "Authorization: Bearer", on unary calls and streams alike.
type Bearer string

func (b Bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}

func (b Bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		c := next(ctx, spec)
		c.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return c
	}
}

func (Bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}
