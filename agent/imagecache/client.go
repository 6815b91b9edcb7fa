package imagecache

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	neturl "net/url"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/a73x/eitri/agent/permanent"
)

// maxRedirects bounds how many redirects one download follows.
const maxRedirects = 5

// get sends GET u and follows redirects itself, up to maxRedirects. Each hop
// gets a transport of its own with keep-alives off, so every hop dials anew
// through the address policy (a pooled connection would skip the check) and
// the policy knows the path the connection is for. Every hop carries hdr (a
// resume's Range and If-Range). It returns the final response and how many
// redirects led to it.
func (c *Cache) get(ctx context.Context, u *neturl.URL, hdr http.Header) (*http.Response, int, error) {
	for hop := 0; ; hop++ {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
		if err != nil {
			return nil, hop, permanent.Wrap(err)
		}
		for k, v := range hdr {
			req.Header[k] = v
		}
		tr := c.transport(u.Path)
		resp, err := tr.RoundTrip(req)
		if err != nil {
			tr.CloseIdleConnections()
			return nil, hop, c.requestError(ctx, err, u, hop)
		}
		resp.Body = &transportBody{ReadCloser: resp.Body, tr: tr}
		switch resp.StatusCode {
		case http.StatusMovedPermanently, http.StatusFound, http.StatusSeeOther,
			http.StatusTemporaryRedirect, http.StatusPermanentRedirect:
		default:
			return resp, hop, nil
		}
		loc := resp.Header.Get("Location")
		resp.Body.Close()
		// The Location is the server's text: errors say which redirect went
		// wrong, never where it pointed.
		if hop == maxRedirects {
			return nil, hop, permanent.Errorf("more than %d redirects", maxRedirects)
		}
		next, err := u.Parse(loc)
		if loc == "" || err != nil || (next.Scheme != "http" && next.Scheme != "https") || next.Host == "" {
			return nil, hop, permanent.Errorf("redirect %d does not lead to an http or https URL", hop+1)
		}
		c.log.Debug("imagecache: following redirect", "from", u.Redacted(), "to", next.Redacted(), "status", resp.StatusCode)
		u = next
	}
}

// transport is a one-request HTTP transport whose every connection is
// checked against the policy at connect time, with the address really being
// dialed (after DNS), for a request to urlPath.
func (c *Cache) transport(urlPath string) *http.Transport {
	d := &net.Dialer{
		Timeout:   30 * time.Second,
		KeepAlive: 30 * time.Second,
		Resolver:  c.resolver,
		ControlContext: func(_ context.Context, _, address string, _ syscall.RawConn) error {
			ap, err := netip.ParseAddrPort(address)
			if err != nil {
				return fmt.Errorf("image download: unexpected dial address %q", address)
			}
			return c.policy.Check(ap, urlPath)
		},
	}
	return &http.Transport{
		// No proxy, from the environment or otherwise: through a proxy the
		// address checked would be the proxy's, and the proxy would fetch
		// whatever it was asked for.
		Proxy:                  nil,
		DialContext:            d.DialContext,
		TLSHandshakeTimeout:    30 * time.Second,
		MaxResponseHeaderBytes: 64 << 10,
		// Images are usually compressed already; transparent gzip would
		// also hide the bytes the digest is of.
		DisableCompression: true,
		DisableKeepAlives:  true,
		ForceAttemptHTTP2:  true,
	}
}

// transportBody closes the hop's transport with the body, so no connection
// or goroutine outlives the download.
type transportBody struct {
	io.ReadCloser
	tr *http.Transport
}

func (b *transportBody) Close() error {
	err := b.ReadCloser.Close()
	b.tr.CloseIdleConnections()
	return err
}

// requestError words a failed request for whoever named the URL. Errors
// from net/http can quote what the server sent (a malformed status line,
// header bytes, names from its certificate), so only errors known to carry
// our own facts (the address dialed, a syscall's errno, a lookup) pass
// through; the rest become a fixed sentence. The operator's log gets the
// original.
func (c *Cache) requestError(ctx context.Context, err error, u *neturl.URL, hop int) error {
	if refused, ok := errors.AsType[*RefusedAddressError](err); ok {
		refused.Redirect = hop
		return permanent.Wrap(refused)
	}
	if ctx.Err() != nil {
		return context.Cause(ctx) // cancelled or stalled: the caller says which
	}
	c.log.Info("imagecache: request failed", "url", u.Redacted(), "redirects", hop, "err", err)
	var op *net.OpError
	var dns *net.DNSError
	var cert *tls.CertificateVerificationError
	var ne net.Error
	var out error
	switch {
	case errors.As(err, &cert):
		out = errors.New("the server's TLS certificate did not verify")
	case errors.As(err, &dns), errors.As(err, &op):
		out = err
	case errors.As(err, &ne) && ne.Timeout():
		out = errors.New("timed out waiting for the server")
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		out = errors.New("the server closed the connection without a response")
	default:
		out = errors.New("the server's answer is not a valid HTTP response")
	}
	if hop > 0 {
		return fmt.Errorf("redirect %d: %w", hop, out)
	}
	return out
}

// statusText is the code and the standard phrase for it.
func statusText(code int) string {
	if t := http.StatusText(code); t != "" {
		return fmt.Sprintf("%d %s", code, t)
	}
	return fmt.Sprintf("HTTP status %d", code)
}

func afterRedirects(n int) string {
	switch n {
	case 0:
		return ""
	case 1:
		return " (after 1 redirect)"
	}
	return fmt.Sprintf(" (after %d redirects)", n)
}

// watchdog ends a download that stops making progress. Within each window,
// progress must happen: first the response must arrive (connecting, every
// redirect and the headers share the first window), then at least floor body
// bytes. A server that trickles a byte every few seconds is making no
// progress, so it cannot hold a create slot until the pass times out. The
// watchdog cancels the download's context with an errStalled cause that
// says which of these failed.
type watchdog struct {
	window time.Duration
	floor  int64
	t      *time.Timer
	began  atomic.Bool
	got    atomic.Int64 // body bytes since the last progress
}

func newWatchdog(window time.Duration, floor int64, cancel context.CancelCauseFunc) *watchdog {
	w := &watchdog{window: window, floor: floor}
	w.t = time.AfterFunc(window, func() { cancel(w.cause()) })
	return w
}

func (w *watchdog) cause() error {
	got := w.got.Load()
	switch {
	case !w.began.Load():
		return fmt.Errorf("%w: no response within %s", errStalled, seconds(w.window))
	case got == 0:
		return fmt.Errorf("%w: no data for %s", errStalled, seconds(w.window))
	}
	return fmt.Errorf("%w: %s in %s, under the minimum of %s per %s",
		errStalled, byteCount(got), seconds(w.window), byteCount(w.floor), seconds(w.window))
}

// progress starts a new window.
func (w *watchdog) progress() {
	w.began.Store(true)
	w.got.Store(0)
	w.t.Reset(w.window)
}

func (w *watchdog) stop() { w.t.Stop() }

func (w *watchdog) reader(r io.Reader) io.Reader { return &watchedReader{r: r, w: w} }

type watchedReader struct {
	r io.Reader
	w *watchdog
}

func (r *watchedReader) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	if n > 0 && r.w.got.Add(int64(n)) >= r.w.floor {
		r.w.progress()
	}
	return n, err
}

func seconds(d time.Duration) string {
	if d >= time.Second && d%time.Second == 0 {
		return fmt.Sprintf("%ds", d/time.Second)
	}
	return d.String()
}

func byteCount(n int64) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}
