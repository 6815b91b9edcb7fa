package fleet

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
)

// Resolve implements auth.Resolver for bearer secrets: personal access tokens
// only. A console session presented here is refused, so a session cookie
// that leaks out of a browser is not a credential anywhere else.
func (f *Fleet) Resolve(ctx context.Context, secret string) (auth.Principal, error) {
	return f.resolve(ctx, secret, store.TokenKindPAT)
}

// ResolveSession implements auth.Resolver for the console's cookie: console
// sessions only.
func (f *Fleet) ResolveSession(ctx context.Context, secret string) (auth.Principal, error) {
	return f.resolve(ctx, secret, store.TokenKindSession)
}

func (f *Fleet) resolve(ctx context.Context, secret, kind string) (auth.Principal, error) {
	tok, user, err := f.st.TokenByHash(ctx, auth.Hash(secret))
	if errors.Is(err, store.ErrNotFound) {
		return auth.Principal{}, auth.ErrBadCredential
	}
	if err != nil {
		return auth.Principal{}, err
	}
	if tok.Kind != kind {
		if tok.Kind == store.TokenKindSession {
			return auth.Principal{}, auth.ErrSessionAsBearer
		}
		return auth.Principal{}, auth.ErrBadCredential
	}
	now := f.now()
	if tok.ExpiresAt != nil && !now.Before(*tok.ExpiresAt) {
		return auth.Principal{}, auth.ErrBadCredential
	}
	// last_used_at is for people reading the token list; minute precision
	// keeps it from turning every request into a write.
	if tok.LastUsedAt == nil || now.Sub(*tok.LastUsedAt) > time.Minute {
		_ = f.st.TouchToken(ctx, tok.ID, now)
	}
	return auth.Principal{
		UserID: user.ID, Name: user.Name, Admin: user.Admin,
		TokenID: tok.ID, ParentID: tok.ParentID, ExpiresAt: tok.ExpiresAt,
	}, nil
}

// mintLimit is the latest expiry a token made by p may have (nil: none).
// A session acts for the token that opened it, so that token's expiry is
// the bound, not the session's shorter one.
func (f *Fleet) mintLimit(ctx context.Context, p auth.Principal) (*time.Time, error) {
	if p.ParentID == "" {
		return p.ExpiresAt, nil
	}
	parent, err := f.st.TokenByID(ctx, p.ParentID)
	if errors.Is(err, store.ErrNotFound) {
		return nil, errorf(Unauthenticated, "the token behind this session was revoked")
	}
	return parent.ExpiresAt, err
}

// credStreams is the registry of open streams by credential, so revoking a
// token or a session ends the streams it opened instead of leaving them
// delivering to whoever held it.
type credStreams struct {
	mu   sync.Mutex
	next uint64
	by   map[string]map[uint64]context.CancelCauseFunc // credential id → streams
}

func (h *credStreams) add(ids []string, cancel context.CancelCauseFunc) uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.by == nil {
		h.by = make(map[string]map[uint64]context.CancelCauseFunc)
	}
	h.next++
	for _, id := range ids {
		if h.by[id] == nil {
			h.by[id] = make(map[uint64]context.CancelCauseFunc)
		}
		h.by[id][h.next] = cancel
	}
	return h.next
}

func (h *credStreams) remove(ids []string, n uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, id := range ids {
		delete(h.by[id], n)
		if len(h.by[id]) == 0 {
			delete(h.by, id)
		}
	}
}

// end cancels every stream held by credential id.
func (h *credStreams) end(id string) {
	h.mu.Lock()
	streams := h.by[id]
	delete(h.by, id)
	h.mu.Unlock()
	for _, cancel := range streams {
		cancel(auth.ErrRevoked)
	}
}

// Hold ties a stream to the credential it was opened with: the returned
// context ends (with cause auth.ErrRevoked or auth.ErrExpired) when that
// credential, or for a session the token behind it, is revoked or expires.
// The caller must call release when the stream ends.
func (f *Fleet) Hold(ctx context.Context, p auth.Principal) (context.Context, func(), error) {
	ctx, cancel := context.WithCancelCause(ctx)
	stop := context.CancelFunc(func() {})
	if p.ExpiresAt != nil {
		ctx, stop = context.WithDeadlineCause(ctx, *p.ExpiresAt, auth.ErrExpired)
	}
	ids := []string{p.TokenID}
	if p.ParentID != "" {
		ids = append(ids, p.ParentID)
	}
	n := f.creds.add(ids, cancel)
	release := func() {
		f.creds.remove(ids, n)
		stop()
		cancel(context.Canceled)
	}
	// Registered first, checked second: a revoke that lands between the
	// stream's authentication and its registration is still seen.
	if _, err := f.st.TokenByID(ctx, p.TokenID); err != nil {
		release()
		if errors.Is(err, store.ErrNotFound) {
			return nil, nil, auth.ErrRevoked
		}
		return nil, nil, err
	}
	return ctx, release, nil
}
