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

// CreateToken mints a personal access token for the caller, or (admins only)
// for a named user, creating that user if new.
func (f *Fleet) CreateToken(ctx context.Context, name string, ttl time.Duration, userName string) (*eitriv1.Token, string, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, "", err
	}
	if name == "" || len(name) > 100 {
		return nil, "", invalid("name", "required, at most 100 characters")
	}
	if ttl < 0 {
		return nil, "", invalid("ttl", "must be positive, got %s", ttl)
	}
	user := store.User{ID: p.UserID, Name: p.Name}
	if userName != "" && userName != p.Name {
		if !p.Admin {
			return nil, "", errorf(Denied, "only an admin may create tokens for another user")
		}
		if !dnsLabel.MatchString(userName) {
			return nil, "", invalid("user_name", "%q must be lowercase letters, digits and '-'", userName)
		}
		user, err = f.st.UserByName(ctx, userName)
		if errors.Is(err, store.ErrNotFound) {
			user = store.User{ID: newID("u"), Name: userName, CreatedAt: f.now()}
			err = f.st.CreateUser(ctx, user)
		}
		if err != nil {
			return nil, "", storeErr(err, "user "+userName)
		}
	}
	secret := auth.NewSecret(auth.PrefixPAT)
	now := f.now()
	t := store.Token{ID: newID("t"), UserID: user.ID, Name: name, Kind: "pat", Hash: auth.Hash(secret), CreatedAt: now}
	if ttl > 0 {
		exp := now.Add(ttl)
		t.ExpiresAt = &exp
	}
	// A token never outlives the one that made it, or a short-lived token
	// could make itself permanent.
	limit, err := f.mintLimit(ctx, p)
	if err != nil {
		return nil, "", err
	}
	if limit != nil && (t.ExpiresAt == nil || t.ExpiresAt.After(*limit)) {
		t.ExpiresAt = limit
	}
	if err := f.st.CreateToken(ctx, t); err != nil {
		return nil, "", err
	}
	return tokenView(t, user.Name), secret, nil
}

// ListTokens lists the caller's tokens (everyone's, for an admin).
func (f *Fleet) ListTokens(ctx context.Context) ([]*eitriv1.Token, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	owner := ownerScope(p)
	toks, err := f.st.ListTokens(ctx, owner)
	if err != nil {
		return nil, err
	}
	names := map[string]string{}
	out := make([]*eitriv1.Token, len(toks))
	for i, t := range toks {
		if _, ok := names[t.UserID]; !ok {
			if u, err := f.st.UserByID(ctx, t.UserID); err == nil {
				names[t.UserID] = u.Name
			}
		}
		out[i] = tokenView(t, names[t.UserID])
	}
	return out, nil
}

// RevokeToken deletes a token and the console sessions it opened; they stop
// working at once, and the streams any of them hold open are closed.
func (f *Fleet) RevokeToken(ctx context.Context, id string) error {
	p, err := principal(ctx)
	if err != nil {
		return err
	}
	if id == "" {
		return invalid("id", "required")
	}
	owner := ownerScope(p)
	if err := f.st.RevokeToken(ctx, id, owner); err != nil {
		return storeErr(err, "token "+id)
	}
	// A session's streams are held under its token's id too.
	f.creds.end(id)
	return nil
}

func tokenView(t store.Token, userName string) *eitriv1.Token {
	out := &eitriv1.Token{Id: t.ID, Name: t.Name, UserId: t.UserID, UserName: userName, CreatedAt: timestamppb.New(t.CreatedAt)}
	if t.ExpiresAt != nil {
		out.ExpiresAt = timestamppb.New(*t.ExpiresAt)
	}
	if t.LastUsedAt != nil {
		out.LastUsedAt = timestamppb.New(*t.LastUsedAt)
	}
	return out
}
