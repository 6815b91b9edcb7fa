package fleet

import (
	"context"
	"errors"
	"time"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
)

// SessionTTL is how long a console login lasts.
const SessionTTL = 7 * 24 * time.Hour

// Login trades a personal access token for a console session secret, kept
// (hashed) as a token of kind "session" so logout can revoke it.
func (f *Fleet) Login(ctx context.Context, pat string) (secret string, p auth.Principal, err error) {
	p, err = f.Resolve(ctx, pat)
	if errors.Is(err, auth.ErrBadCredential) {
		return "", p, errorf(Unauthenticated, "that token is not valid (revoked, expired or mistyped)")
	}
	if err != nil {
		return "", p, err
	}
	secret = auth.NewSecret(auth.PrefixSession)
	now := f.now()
	exp := now.Add(SessionTTL)
	err = f.st.CreateToken(ctx, store.Token{
		ID: newID("s"), UserID: p.UserID, Name: "console session", Kind: store.TokenKindSession,
		Hash: auth.Hash(secret), CreatedAt: now, ExpiresAt: &exp,
	})
	return secret, p, err
}

// Logout revokes the session the caller is using.
func (f *Fleet) Logout(ctx context.Context) error {
	p, err := principal(ctx)
	if err != nil {
		return err
	}
	return storeErr(f.st.RevokeToken(ctx, p.TokenID, p.UserID), "session")
}
