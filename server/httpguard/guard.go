// Package httpguard is what every request to the control plane passes before
// a handler sees it. The caller is checked from the headers alone, so a
// request without a good credential never has a byte of its body read, let
// alone inflated; a body is bounded in size and in the time it may take to
// arrive; and every response carries the headers that keep browsers from
// framing pages or guessing content types.
package httpguard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"time"

	"connectrpc.com/connect"
)

// Rule is what one route allows.
type Rule struct {
	// Check authenticates the request from its headers. A *connect.Error
	// says how to refuse (its code); any other error refuses as
	// Unauthenticated. The context it returns (carrying who was
	// authenticated) is the one the handler gets, so the credential is not
	// looked up twice. Nil means the route is open: it needs no credential,
	// or its body is the credential (a join token, a login), so MaxBody
	// should be small.
	Check func(*http.Request) (context.Context, error)
	// MaxBody bounds the body as sent, before any decompression. 0 leaves it
	// unbounded here: a stream, whose handler bounds each message instead.
	MaxBody int64
	// Stream marks a body that lasts as long as the request (the agent's
	// Sync stream): it gets no read deadline.
	Stream bool
	// RPC routes are refused in the caller's RPC protocol (Connect, gRPC,
	// gRPC-Web), so generated clients read a code and a message.
	RPC bool
}

// Guard applies a Rule to every request.
type Guard struct {
	// Route picks the rule for a request (by its path).
	Route func(*http.Request) Rule
	// BodyTimeout is how long a body that is not a Stream may take to
	// arrive in full, counted from when its headers are in. A body that
	// trickles in slower is cut off and the request fails.
	BodyTimeout time.Duration
	Log         *slog.Logger
	// Refused, when set, is told of each RPC call refused here, with the
	// code it was refused with (no handler, so no interceptor, sees it).
	Refused func(r *http.Request, code connect.Code)
}

// Wrap returns next behind the guard.
func (g *Guard) Wrap(next http.Handler) http.Handler {
	log := g.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	errw := connect.NewErrorWriter()
	deny := func(w http.ResponseWriter, r *http.Request, rule Rule, err *connect.Error) {
		if rule.RPC && g.Refused != nil {
			g.Refused(r, err.Code())
		}
		refuse(w, r, rule, errw, err)
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		setBaseHeaders(w.Header())
		rule := g.Route(r)
		if rule.Check != nil {
			ctx, err := rule.Check(r)
			if err != nil {
				ce := asConnectError(err)
				if ce.Code() == connect.CodeInternal {
					log.Error("checking credentials", "path", r.URL.Path, "err", err)
					ce = connect.NewError(connect.CodeInternal, errors.New("could not check the credentials (see the control plane's log)"))
				}
				deny(w, r, rule, ce)
				return
			}
			r = r.WithContext(ctx)
		}
		if rule.MaxBody > 0 && r.ContentLength > rule.MaxBody {
			deny(w, r, rule, connect.NewError(connect.CodeResourceExhausted,
				fmt.Errorf("request body of %d bytes is over the limit of %d bytes for %s", r.ContentLength, rule.MaxBody, r.URL.Path)))
			return
		}
		if !rule.Stream && g.BodyTimeout > 0 && hasBody(r) {
			rc := http.NewResponseController(w)
			if err := rc.SetReadDeadline(time.Now().Add(g.BodyTimeout)); err == nil {
				body := &deadlineBody{ReadCloser: r.Body, rc: rc, timeout: g.BodyTimeout}
				if r.ProtoMajor == 1 {
					// After a timed-out read net/http would keep the
					// connection and parse the rest of the trickle as the
					// next request; close it instead.
					hdr := w.Header()
					body.onTimeout = func() { hdr.Set("Connection", "close") }
				}
				r.Body = body
			}
		}
		if rule.MaxBody > 0 {
			// A body without a Content-Length (chunked, or HTTP/2 without
			// one) is cut off here instead; Connect reports it as
			// ResourceExhausted.
			r.Body = http.MaxBytesReader(w, r.Body, rule.MaxBody)
		}
		next.ServeHTTP(w, r)
	})
}

// hasBody is false for a request that declared none: such a request must
// not get a read deadline, because on HTTP/1 the server's background read
// would then cancel a long response (an MCP event stream) when it fired.
func hasBody(r *http.Request) bool {
	return r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0
}

// deadlineBody lifts the read deadline once the body has arrived in full, so
// the deadline bounds the upload and never the response (a Watch stream
// runs for hours after its one request message).
type deadlineBody struct {
	io.ReadCloser
	rc        *http.ResponseController
	timeout   time.Duration
	onTimeout func()
	done      bool
}

func (b *deadlineBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	switch {
	case err == io.EOF && !b.done:
		b.done = true
		_ = b.rc.SetReadDeadline(time.Time{})
	case errors.Is(err, os.ErrDeadlineExceeded):
		if b.onTimeout != nil {
			b.onTimeout()
		}
		err = connect.NewError(connect.CodeDeadlineExceeded, fmt.Errorf("the request body did not arrive within %s", b.timeout))
	}
	return n, err
}

func asConnectError(err error) *connect.Error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	return connect.NewError(connect.CodeUnauthenticated, err)
}

// refuse answers without reading the body: on an RPC route in the caller's
// protocol, elsewhere in the JSON shape the other routes use. An HTTP/1
// connection is closed right after the answer. "Connection: close" alone
// does not do it: once the handler returns, net/http still reads up to
// 256 KiB of an unread body (to find its end), at whatever pace the sender
// trickles it, before it closes. A read deadline already past makes that
// read fail at once. (HTTP/2 resets the stream after the answer.)
func refuse(w http.ResponseWriter, r *http.Request, rule Rule, errw *connect.ErrorWriter, err *connect.Error) {
	if r.ProtoMajor == 1 {
		w.Header().Set("Connection", "close")
		_ = http.NewResponseController(w).SetReadDeadline(time.Now())
	}
	if rule.RPC {
		_ = errw.Write(w, r, err)
		return
	}
	status := http.StatusInternalServerError
	switch err.Code() {
	case connect.CodeUnauthenticated:
		status = http.StatusUnauthorized
		w.Header().Set("WWW-Authenticate", `Bearer realm="eitri"`)
	case connect.CodeResourceExhausted:
		status = http.StatusRequestEntityTooLarge
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"code": err.Code().String(), "message": err.Message()})
}
