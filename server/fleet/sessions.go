package fleet

import (
	"context"
	"errors"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
)

// SessionTTL is how long a console login lasts.
const SessionTTL = 7 * 24 * time.Hour

// Login trades a personal access token for a console session secret, kept
// (hashed) as a token of kind "session" so logout can revoke it. Only a
// personal access token opens one (a session cannot renew itself), and the
// session belongs to that token: it expires no later than the token and is
// deleted with it.
func (f *Fleet) Login(ctx context.Context, pat string) (secret string, exp time.Time, err error) {
	p, err := f.Resolve(ctx, pat)
	if errors.Is(err, auth.ErrBadCredential) {
		return "", exp, errorf(Unauthenticated, "that token is not valid (revoked, expired, mistyped or not a personal access token)")
	}
	if err != nil {
		return "", exp, err
	}
	secret = auth.NewSecret(auth.PrefixSession)
	now := f.now()
	exp = now.Add(SessionTTL)
	if p.ExpiresAt != nil && p.ExpiresAt.Before(exp) {
		exp = *p.ExpiresAt
	}
	err = f.st.CreateToken(ctx, store.Token{
		ID: newID("s"), UserID: p.UserID, Name: "console session", Kind: store.TokenKindSession,
		Hash: auth.Hash(secret), CreatedAt: now, ExpiresAt: &exp, ParentID: p.TokenID,
	})
	if errors.Is(err, store.ErrNotFound) {
		// The token was revoked while we looked at it.
		return "", exp, errorf(Unauthenticated, "that token was just revoked")
	}
	return secret, exp, err
}

// Logout ends the session the caller is using.
func (f *Fleet) Logout(ctx context.Context) error {
	p, err := principal(ctx)
	if err != nil {
		return err
	}
	if err := f.st.RevokeSession(ctx, p.TokenID, p.UserID); err != nil {
		return storeErr(err, "session")
	}
	f.creds.end(p.TokenID)
	return nil
}

// ListSessions lists the caller's console sessions (everyone's, for an
// admin), marking the one the call came with.
func (f *Fleet) ListSessions(ctx context.Context) ([]*eitriv1.Session, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	rows, err := f.st.ListSessions(ctx, ownerScope(p))
	if err != nil {
		return nil, err
	}
	out := make([]*eitriv1.Session, len(rows))
	for i, s := range rows {
		v := &eitriv1.Session{
			Id: s.ID, UserId: s.UserID, UserName: s.UserName, TokenId: s.ParentID, TokenName: s.ParentName,
			CreatedAt: timestamppb.New(s.CreatedAt), Current: s.ID == p.TokenID,
		}
		if s.ExpiresAt != nil {
			v.ExpiresAt = timestamppb.New(*s.ExpiresAt)
		}
		if s.LastUsedAt != nil {
			v.LastUsedAt = timestamppb.New(*s.LastUsedAt)
		}
		out[i] = v
	}
	return out, nil
}

// RevokeSession ends a console session (the caller's own; any, for an
// admin) and closes the streams it holds open. Someone else's session reads
// as not found, so its id is not confirmed to exist.
func (f *Fleet) RevokeSession(ctx context.Context, id string) error {
	p, err := principal(ctx)
	if err != nil {
		return err
	}
	if id == "" {
		return invalid("id", "required")
	}
	if err := f.st.RevokeSession(ctx, id, ownerScope(p)); err != nil {
		return storeErr(err, "session "+id)
	}
	f.creds.end(id)
	return nil
}
