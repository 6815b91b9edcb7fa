// Package mcp serves the fleet to language-model clients over the Model
// Context Protocol (streamable HTTP). Every HTTP request carries a bearer
// token; each tool call runs as the principal that token resolves to, so the
// fleet authorizes it exactly as it would a Connect call.
package mcp

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"

	mcpauth "github.com/modelcontextprotocol/go-sdk/auth"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
)

// principalKey is where the resolved principal rides in the go-sdk's token
// info, which is the only per-request value the SDK hands to tool handlers.
const principalKey = "eitri.principal"

// Handler returns the MCP endpoint (mount it at /mcp) with DefaultLimits.
func Handler(f *fleet.Fleet, log *slog.Logger) http.Handler {
	return HandlerWithLimits(f, log, DefaultLimits)
}

// HandlerWithLimits returns the MCP endpoint holding each user to lim.
func HandlerWithLimits(f *fleet.Fleet, log *slog.Logger, lim Limits) http.Handler {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	lim = lim.withDefaults()
	srv := mcp.NewServer(&mcp.Implementation{Name: "eitri", Version: "v1"}, nil)
	t := &tools{f: f, log: log}
	t.register(srv)
	sessions := newSessionTable(lim, log)
	srv.AddReceivingMiddleware(t.checks.middleware, sessions.middleware)

	// A client whose session was closed (idle, or evicted) gets a 404 and,
	// as the transport requires, initializes a new one.
	h := mcp.NewStreamableHTTPHandler(func(*http.Request) *mcp.Server { return srv }, &mcp.StreamableHTTPOptions{
		Logger:         log,
		SessionTimeout: lim.SessionIdle,
	})
	// The SDK middleware carries the principal into each request's token
	// info, and its UserID pins a session to the user who opened it.
	carry := mcpauth.RequireBearerToken(func(ctx context.Context, _ string, _ *http.Request) (*mcpauth.TokenInfo, error) {
		p, ok := auth.FromContext(ctx)
		if !ok {
			return nil, mcpauth.ErrInvalidToken
		}
		return &mcpauth.TokenInfo{UserID: p.UserID, Extra: map[string]any{principalKey: p}}, nil
	}, &mcpauth.RequireBearerTokenOptions{AllowMissingExpiration: true})
	return authenticate(f, log, sessions.gate(f, carry(h)))
}

// authenticate resolves the bearer token before the SDK sees the request, so
// a bad token gets a JSON 401 like the rest of the API.
func authenticate(f *fleet.Fleet, log *slog.Logger, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Only a bearer token: the console's session cookie must not let a
		// cross-site page drive tools.
		secret := ""
		if r.Header.Get("Authorization") != "" {
			secret = auth.Secret(r.Header)
		}
		if secret == "" {
			writeJSONError(w, http.StatusUnauthorized, "unauthenticated", "missing credentials: send Authorization: Bearer <token>")
			return
		}
		p, err := f.Resolve(r.Context(), secret)
		if errors.Is(err, auth.ErrBadCredential) {
			writeJSONError(w, http.StatusUnauthorized, "unauthenticated", err.Error())
			return
		}
		if err != nil {
			log.Error("mcp: resolve token", "err", err)
			writeJSONError(w, http.StatusInternalServerError, "internal", "could not check the token")
			return
		}
		// Held for the request's life: a tool call waiting on a VM, or the
		// notification stream, ends when its token is revoked.
		ctx, release, err := f.Hold(auth.WithPrincipal(r.Context(), p), p)
		if errors.Is(err, auth.ErrRevoked) {
			writeJSONError(w, http.StatusUnauthorized, "unauthenticated", err.Error())
			return
		}
		if err != nil {
			log.Error("mcp: hold token", "err", err)
			writeJSONError(w, http.StatusInternalServerError, "internal", "could not check the token")
			return
		}
		defer release()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

func writeJSONError(w http.ResponseWriter, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/json")
	if status == http.StatusUnauthorized {
		w.Header().Set("WWW-Authenticate", `Bearer realm="eitri"`)
	}
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]string{"code": code, "message": msg})
}

// withPrincipal returns ctx carrying the principal the request was
// authenticated as.
func withPrincipal(ctx context.Context, req *mcp.CallToolRequest) (context.Context, error) {
	if req != nil && req.Extra != nil && req.Extra.TokenInfo != nil {
		if p, ok := req.Extra.TokenInfo.Extra[principalKey].(auth.Principal); ok {
			return auth.WithPrincipal(ctx, p), nil
		}
	}
	return ctx, errors.New("missing credentials")
}
