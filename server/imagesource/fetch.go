package imagesource

import (
	"context"
	"crypto/sha256"
	"crypto/sha512"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"syscall"
	"time"

	"github.com/a73x/eitri/wire/addrpolicy"
)

// Bounds on what a catalogue fetch reads. A SUMS file of a whole release
// directory is tens of KiB; a signature or a distribution's keyring a few.
const (
	MaxSumsBytes      = 1 << 20
	MaxSignatureBytes = 64 << 10
	// MaxKeyringBytes holds a distribution's few signing keys with room
	// to spare; it rides in the AddImage request.
	MaxKeyringBytes = 256 << 10
	// MaxImageBytes bounds the one download that hashes an image.
	MaxImageBytes = 64 << 30
	maxRedirects  = 5
	// smallFetchTimeout bounds a SUMS or signature fetch as a whole.
	smallFetchTimeout = time.Minute
	// stallAfter ends an image download that sends nothing for this long.
	stallAfter = time.Minute
)

// FieldError is a failure to be reported against the request field whose
// URL or content caused it.
type FieldError struct {
	Field string
	Err   error
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Err.Error() }
func (e *FieldError) Unwrap() error { return e.Err }

func fieldErr(field string, format string, args ...any) error {
	return &FieldError{Field: field, Err: fmt.Errorf(format, args...)}
}

// Fetcher downloads what the catalogue is told to trust, through the same
// address policy as hosts' image downloads: the URLs are an admin's, but a
// control plane must not be pointed at its own loopback or its network's
// metadata service by them either.
type Fetcher struct {
	Policy addrpolicy.Policy
	// Resolver looks names up; nil: the system's.
	Resolver *net.Resolver
}

// Small fetches a file of at most max bytes, whole.
func (f Fetcher) Small(ctx context.Context, field, rawURL string, max int64) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, smallFetchTimeout)
	defer cancel()
	resp, err := f.get(ctx, field, rawURL)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.ContentLength > max {
		return nil, fieldErr(field, "the file is %d bytes, more than the %d this fetch reads", resp.ContentLength, max)
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, max+1))
	if err != nil {
		return nil, fieldErr(field, "reading the answer: %v", bodyError(ctx, err))
	}
	if int64(len(data)) > max {
		return nil, fieldErr(field, "the file is more than the %d bytes this fetch reads", max)
	}
	return data, nil
}

// Sums are an image's digests and size, as downloaded.
type Sums struct {
	SHA256, SHA512 string
	Size           int64
}

// Hash downloads an image once and digests what was served.
func (f Fetcher) Hash(ctx context.Context, field, rawURL string) (Sums, error) {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	resp, err := f.get(ctx, field, rawURL)
	if err != nil {
		return Sums{}, err
	}
	defer resp.Body.Close()
	if resp.ContentLength > MaxImageBytes {
		return Sums{}, fieldErr(field, "the image is %d bytes, more than the %d a catalogue image may be", resp.ContentLength, int64(MaxImageBytes))
	}
	stall := time.AfterFunc(stallAfter, func() { cancel(errors.New("the server sent nothing for a minute")) })
	defer stall.Stop()
	h256, h512 := sha256.New(), sha512.New()
	buf := make([]byte, 256<<10)
	var n int64
	for {
		k, rerr := resp.Body.Read(buf)
		if k > 0 {
			stall.Reset(stallAfter)
			h256.Write(buf[:k])
			h512.Write(buf[:k])
			n += int64(k)
			if n > MaxImageBytes {
				return Sums{}, fieldErr(field, "the image is more than the %d bytes a catalogue image may be", int64(MaxImageBytes))
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return Sums{}, fieldErr(field, "downloading the image: %v", bodyError(ctx, rerr))
		}
	}
	return Sums{SHA256: hex.EncodeToString(h256.Sum(nil)), SHA512: hex.EncodeToString(h512.Sum(nil)), Size: n}, nil
}

func bodyError(ctx context.Context, err error) error {
	if cause := context.Cause(ctx); cause != nil {
		return cause
	}
	if errors.Is(err, io.ErrUnexpectedEOF) {
		return errors.New("the server closed the connection early")
	}
	return errors.New("the connection failed")
}

// get sends GET and follows redirects itself, each hop on a transport of
// its own with keep-alives off, so every connection is dialed anew through
// the policy with the path it is for. Errors say what went wrong in our
// words, never what the server sent.
func (f Fetcher) get(ctx context.Context, field, rawURL string) (*http.Response, error) {
	u, err := url.Parse(rawURL)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fieldErr(field, "not an http(s) URL")
	}
	for hop := 0; ; hop++ {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
		if err != nil {
			return nil, fieldErr(field, "not a URL that can be requested")
		}
		tr := f.transport(u.Path)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			tr.CloseIdleConnections()
			return nil, f.requestError(ctx, field, err, hop)
		}
		resp.Body = &closingBody{ReadCloser: resp.Body, tr: tr}
		switch resp.StatusCode {
		case http.StatusOK:
			return resp, nil
		case http.StatusMovedPermanently, http.StatusFound, http.StatusSeeOther,
			http.StatusTemporaryRedirect, http.StatusPermanentRedirect:
		default:
			resp.Body.Close()
			return nil, fieldErr(field, "the server answered %d %s", resp.StatusCode, http.StatusText(resp.StatusCode))
		}
		loc := resp.Header.Get("Location")
		resp.Body.Close()
		if hop == maxRedirects {
			return nil, fieldErr(field, "more than %d redirects", maxRedirects)
		}
		next, err := u.Parse(loc)
		if loc == "" || err != nil || (next.Scheme != "http" && next.Scheme != "https") || next.Host == "" {
			return nil, fieldErr(field, "redirect %d does not lead to an http or https URL", hop+1)
		}
		u = next
	}
}

func (f Fetcher) requestError(ctx context.Context, field string, err error, hop int) error {
	if refused, ok := errors.AsType[*addrpolicy.RefusedError](err); ok {
		r := *refused
		r.Field, r.Redirect = field, hop
		return &FieldError{Field: field, Err: fmt.Errorf("%s", trimField(r.Error(), field))}
	}
	if ctx.Err() != nil {
		return fieldErr(field, "%v", context.Cause(ctx))
	}
	var cert *tls.CertificateVerificationError
	var dns *net.DNSError
	var op *net.OpError
	switch {
	case errors.As(err, &cert):
		return fieldErr(field, "the server's TLS certificate did not verify")
	case errors.As(err, &dns):
		return fieldErr(field, "the host name does not resolve")
	case errors.As(err, &op):
		return fieldErr(field, "could not connect: %v", op.Err)
	}
	return fieldErr(field, "the server's answer is not a valid HTTP response")
}

// trimField drops the "field: " RefusedError starts with, which FieldError
// adds again.
func trimField(s, field string) string {
	if len(s) > len(field)+2 && s[:len(field)+2] == field+": " {
		return s[len(field)+2:]
	}
	return s
}

func (f Fetcher) transport(urlPath string) *http.Transport {
	d := &net.Dialer{
		Timeout:  30 * time.Second,
		Resolver: f.Resolver,
		ControlContext: func(_ context.Context, _, address string, _ syscall.RawConn) error {
			ap, err := netip.ParseAddrPort(address)
			if err != nil {
				return fmt.Errorf("unexpected dial address %q", address)
			}
			return f.Policy.Check(ap, urlPath)
		},
	}
	return &http.Transport{
		Proxy:                  nil, // through a proxy the address checked would be the proxy's
		DialContext:            d.DialContext,
		TLSHandshakeTimeout:    30 * time.Second,
		ResponseHeaderTimeout:  time.Minute,
		MaxResponseHeaderBytes: 64 << 10,
		DisableCompression:     true, // the digest is of the bytes as served
		DisableKeepAlives:      true,
		ForceAttemptHTTP2:      true,
	}
}

type closingBody struct {
	io.ReadCloser
	tr *http.Transport
}

func (b *closingBody) Close() error {
	err := b.ReadCloser.Close()
	b.tr.CloseIdleConnections()
	return err
}
