// Package auth holds who is calling: bearer secrets (made and hashed here),
// the principal a request runs as, and the Connect interceptor that resolves
// one from the Authorization header or the console's session cookie.
package auth

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base32"
	"errors"
	"net/http"
	"strings"

	"connectrpc.com/connect"
)

// Secret prefixes say what a leaked string is at a glance (and let secret
// scanners find them).
const (
	PrefixPAT     = "eitri_pat_"
	PrefixSession = "eitri_ses_"
	PrefixHost    = "eitri_host_"
	PrefixJoin    = "eitri_join_"
)

// SessionCookie is the console's HttpOnly cookie.
const SessionCookie = "eitri_session"

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
	TokenID string
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

// Secret extracts the presented secret: a bearer token first, the session
// cookie otherwise.
func Secret(h http.Header) string {
	if v := h.Get("Authorization"); v != "" {
		if tok, ok := strings.CutPrefix(v, "Bearer "); ok {
			return strings.TrimSpace(tok)
		}
		return ""
	}
	r := http.Request{Header: h}
	if c, err := r.Cookie(SessionCookie); err == nil {
		return c.Value
	}
	return ""
}

// Interceptor authenticates every user-facing RPC. Procedures listed in skip
// (the agent's service, which has its own credentials) pass through.
type Interceptor struct {
	Resolve Resolver
	Skip    func(procedure string) bool
}

func (i Interceptor) authenticate(ctx context.Context, procedure string, h http.Header) (context.Context, error) {
	if i.Skip != nil && i.Skip(procedure) {
		return ctx, nil
	}
	secret := Secret(h)
	if secret == "" {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing credentials: send Authorization: Bearer <token>"))
	}
	p, err := i.Resolve(ctx, secret)
	if err != nil {
		if errors.Is(err, ErrBadCredential) {
			return nil, connect.NewError(connect.CodeUnauthenticated, err)
		}
		return nil, connect.NewError(connect.CodeInternal, err)
	}
	return WithPrincipal(ctx, p), nil
}

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
		return next(ctx, conn)
	}
}
