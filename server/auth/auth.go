// Package auth holds who is calling: bearer secrets (made and hashed here),
// the principal a request runs as, and the Connect interceptor that resolves
// one from the Authorization header (personal access tokens only) or the
// console's session cookie (only on requests from the console's own pages).
package auth

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
)

// Secret prefixes say what a leaked string is at a glance (and let secret
// scanners find them). Join tokens carry wire/jointoken.Prefix.
const (
	PrefixPAT     = "eitri_pat_"
	PrefixSession = "eitri_ses_"
	PrefixHost    = "eitri_host_"
)

// The console's HttpOnly session cookie. Over TLS it is __Host- prefixed
// (Secure, Path=/, no Domain), so the browser refuses one set by a plain-HTTP
// page or for a parent domain. Plain HTTP (dev mode, loopback only) cannot use
// the prefix, which browsers accept only on Secure cookies, nor Secure itself
// (an http:// origin may not set one), so there the cookie keeps a plain name.
const (
	SessionCookie    = "eitri_session"
	SessionCookieTLS = "__Host-eitri_session"
)

// SessionCookieName is the cookie name for a request over TLS or not.
func SessionCookieName(tls bool) string {
	if tls {
		return SessionCookieTLS
	}
	return SessionCookie
}

// NewSecret returns prefix + 160 random bits, base32.
func NewSecret(prefix string) string {
	var b [20]byte
	_, _ = rand.Read(b[:])
	return prefix + strings.ToLower(base32.StdEncoding.WithPadding(base32.NoPadding).EncodeToString(b[:]))
}

// Hash is how secrets are stored. They carry 160 random bits, so a fast hash
// is enough: there is nothing to brute-force.
func Hash(secret string) []byte {
	sum := sha256.Sum256([]byte(secret))
	return sum[:]
}

// Principal is the user a request acts for.
type Principal struct {
	UserID  string
	Name    string
	Admin   bool
	TokenID string // the credential presented (a token or a session)
	// ParentID is, for a console session, the token that opened it.
	ParentID string
	// ExpiresAt is when the presented credential stops working; nil: never.
	ExpiresAt *time.Time
}

type principalKey struct{}

// WithPrincipal returns ctx carrying p.
func WithPrincipal(ctx context.Context, p Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// FromContext returns the principal the interceptor attached.
func FromContext(ctx context.Context) (Principal, bool) {
	p, ok := ctx.Value(principalKey{}).(Principal)
	return p, ok
}

// ErrBadCredential is what a Resolver returns for an unknown, revoked or
// expired secret.
var ErrBadCredential = errors.New("invalid, revoked or expired token")

// Resolver turns a presented secret into a principal.
type Resolver func(ctx context.Context, secret string) (Principal, error)

// Secret returns the secret of an "Authorization: Bearer" header, or "".
// The scheme is case-insensitive (RFC 9110 §11.1: "bearer" and "BEARER"
// are Bearer too). It never reads the console's cookie: see SessionSecret.
func Secret(h http.Header) string {
	scheme, tok, ok := strings.Cut(strings.TrimSpace(h.Get("Authorization")), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	return strings.TrimSpace(tok)
}

// ErrSessionAsBearer refuses a console session presented as a bearer token:
// a session is good only in the console's cookie, so a copy that leaked out
// of a browser (say, to a tenant's port on the same host) is worth nothing.
// It wraps ErrBadCredential, so callers that only know that one still answer
// 401.
var ErrSessionAsBearer = fmt.Errorf("%w: a console session is not a bearer token, send a personal access token", ErrBadCredential)

// FromConsole reports whether a browser says r came from a page of this same
// origin. Sec-Fetch-Site is set by the browser and cannot be forged by a
// page; a client that sends none is not a browser and has no ambient cookie
// to abuse. "same-site" is refused on purpose: a tenant's published port on
// the console's host is the same site.
func FromConsole(r *http.Request) bool {
	site := r.Header.Get("Sec-Fetch-Site")
	return site == "" || site == "same-origin"
}

// SessionSecret returns the session secret in r's console cookie, or "" when
// there is none or the request did not come from the console's own pages.
func SessionSecret(r *http.Request) string {
	if !FromConsole(r) {
		return ""
	}
	c, err := r.Cookie(SessionCookieName(r.TLS != nil))
	if err != nil {
		return ""
	}
	return c.Value
}

type sessionKey struct{}

// Console lets the Connect handlers behind it accept the console's cookie:
// it hands the interceptor (which sees headers, not the connection) the
// session secret as SessionSecret read it. Handlers not wrapped take bearer
// tokens only.
func Console(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s := SessionSecret(r); s != "" {
			r = r.WithContext(context.WithValue(r.Context(), sessionKey{}, s))
		}
		next.ServeHTTP(w, r)
	})
}

// Interceptor authenticates every user-facing RPC. Procedures listed in skip
// (the agent's service, which has its own credentials) pass through.
type Interceptor struct {
	// Resolve takes personal access tokens, ResolveSession console sessions.
	Resolve, ResolveSession Resolver
	Skip                    func(procedure string) bool
	// Hold, if set, ties a stream to its credential: the returned context
	// ends when the credential is revoked or expires, and release is called
	// when the stream ends.
	Hold func(ctx context.Context, p Principal) (held context.Context, release func(), err error)
}

func (i Interceptor) authenticate(ctx context.Context, procedure string, h http.Header) (context.Context, error) {
	if i.Skip != nil && i.Skip(procedure) {
		return ctx, nil
	}
	if _, ok := FromContext(ctx); ok {
		// The HTTP guard in front already resolved this request's
		// credential; a context value is never set from the wire.
		return ctx, nil
	}
	resolve, secret := i.Resolve, Secret(h)
	switch {
	case h.Get("Authorization") == "":
		// No header: the console's cookie, if Console found one.
		resolve = i.ResolveSession
		secret, _ = ctx.Value(sessionKey{}).(string)
	case strings.HasPrefix(secret, PrefixSession):
		return nil, connect.NewError(connect.CodeUnauthenticated, ErrSessionAsBearer)
	}
	if secret == "" || resolve == nil {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing credentials: send Authorization: Bearer <token>"))
	}
	p, err := resolve(ctx, secret)
	if err != nil {
		return nil, credentialError(err)
	}
	return WithPrincipal(ctx, p), nil
}

func credentialError(err error) error {
	for _, bad := range []error{ErrBadCredential, ErrRevoked, ErrExpired} {
		if errors.Is(err, bad) {
			return connect.NewError(connect.CodeUnauthenticated, err)
		}
	}
	return connect.NewError(connect.CodeInternal, err)
}

// A held stream's context ends with one of these causes.
var (
	ErrRevoked = errors.New("the credential of this stream was revoked")
	ErrExpired = errors.New("the credential of this stream expired")
)

// WrapUnary implements connect.Interceptor.
func (i Interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if req.Spec().IsClient {
			return next(ctx, req)
		}
		ctx, err := i.authenticate(ctx, req.Spec().Procedure, req.Header())
		if err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

// WrapStreamingClient implements connect.Interceptor.
func (i Interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

// WrapStreamingHandler implements connect.Interceptor.
func (i Interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, err := i.authenticate(ctx, conn.Spec().Procedure, conn.RequestHeader())
		if err != nil {
			return err
		}
		p, ok := FromContext(ctx)
		if !ok || i.Hold == nil {
			return next(ctx, conn)
		}
		ctx, release, err := i.Hold(ctx, p)
		if err != nil {
			return credentialError(err)
		}
		defer release()
		err = next(ctx, conn)
		// A stream cut off by its credential says why, rather than ending
		// as if the server had finished.
		if cause := context.Cause(ctx); errors.Is(cause, ErrRevoked) || errors.Is(cause, ErrExpired) {
			return connect.NewError(connect.CodeUnauthenticated, cause)
		}
		return err
	}
}
