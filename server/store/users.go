package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// User is a person (or automation) that owns VMs and tokens.
type User struct {
	ID, Name  string
	Admin     bool
	CreatedAt time.Time
}

// Token kinds.
const (
	TokenKindPAT     = "pat"
	TokenKindSession = "session"
)

// Token is a bearer credential of a user, stored only as the sha256 of its
// secret.
type Token struct {
	ID, UserID, Name string
	Kind             string // TokenKindPAT or TokenKindSession
	Hash             []byte // sha256 of the secret; unique
	CreatedAt        time.Time
	ExpiresAt        *time.Time
	LastUsedAt       *time.Time
	// ParentID is, for a session, the token that opened it; deleting that
	// token deletes the session. Empty for a PAT.
	ParentID string
}

// CreateUser inserts u. A zero CreatedAt is set to now. A taken name (or id)
// is ErrConflict.
func (s *Store) CreateUser(ctx context.Context, u User) error {
	if u.ID == "" || u.Name == "" {
		return errors.New("store: user needs an id and a name")
	}
	return s.write(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO users (id, name, admin, created_at) VALUES ($1, $2, $3, $4)`,
			u.ID, u.Name, u.Admin, nanos(s.orNow(u.CreatedAt)))
		if isUniqueViolation(err) {
			return fmt.Errorf("%w: user %q already exists", ErrConflict, u.Name)
		}
		return err
	})
}

const userCols = `id, name, admin, created_at`

func scanUser(row interface{ Scan(...any) error }) (User, error) {
	var u User
	var created int64
	if err := row.Scan(&u.ID, &u.Name, &u.Admin, &created); err != nil {
		return User{}, err
	}
	u.CreatedAt = fromNanos(created)
	return u, nil
}

// UserByID returns the user with this id, or ErrNotFound.
func (s *Store) UserByID(ctx context.Context, id string) (User, error) {
	u, err := scanUser(s.db.QueryRowContext(ctx, `SELECT `+userCols+` FROM users WHERE id = $1`, id))
	return u, notFound(err, "user "+id)
}

// UserByName returns the user with this name, or ErrNotFound.
func (s *Store) UserByName(ctx context.Context, name string) (User, error) {
	u, err := scanUser(s.db.QueryRowContext(ctx, `SELECT `+userCols+` FROM users WHERE name = $1`, name))
	return u, notFound(err, fmt.Sprintf("user %q", name))
}

// CountUsers returns how many users exist (zero means first start).
func (s *Store) CountUsers(ctx context.Context) (int, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM users`).Scan(&n)
	return n, err
}

// CreateToken inserts t. A zero CreatedAt is set to now. The owner must
// exist (ErrNotFound otherwise); a reused hash or id is ErrConflict.
func (s *Store) CreateToken(ctx context.Context, t Token) error {
	if t.ID == "" || t.UserID == "" || len(t.Hash) == 0 {
		return errors.New("store: token needs an id, a user and a hash")
	}
	switch {
	case t.Kind != TokenKindPAT && t.Kind != TokenKindSession:
		return fmt.Errorf("store: invalid token kind %q", t.Kind)
	case (t.Kind == TokenKindSession) != (t.ParentID != ""):
		// A session without a token behind it would outlive its source.
		return errors.New("store: a session needs the token that opened it, and only a session has one")
	}
	var parent any
	if t.ParentID != "" {
		parent = t.ParentID
	}
	return s.write(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO tokens (id, user_id, name, kind, hash, created_at, expires_at, last_used_at, parent_id)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
			t.ID, t.UserID, t.Name, t.Kind, t.Hash, nanos(s.orNow(t.CreatedAt)), nullNanos(t.ExpiresAt), nullNanos(t.LastUsedAt), parent)
		switch {
		case isUniqueViolation(err):
			return fmt.Errorf("%w: token %s already exists", ErrConflict, t.ID)
		case isForeignKeyViolation(err):
			return fmt.Errorf("%w: user %s or token %s", ErrNotFound, t.UserID, t.ParentID)
		}
		return err
	})
}

const tokenCols = `t.id, t.user_id, t.name, t.kind, t.hash, t.created_at, t.expires_at, t.last_used_at, t.parent_id`

func scanToken(row interface{ Scan(...any) error }, extra ...any) (Token, error) {
	var t Token
	var created int64
	var expires, used sql.NullInt64
	var parent sql.NullString
	dest := append([]any{&t.ID, &t.UserID, &t.Name, &t.Kind, &t.Hash, &created, &expires, &used, &parent}, extra...)
	if err := row.Scan(dest...); err != nil {
		return Token{}, err
	}
	t.ParentID = parent.String
	t.CreatedAt = fromNanos(created)
	t.ExpiresAt = fromNullNanos(expires)
	t.LastUsedAt = fromNullNanos(used)
	return t, nil
}

// TokenByHash returns the token with this secret hash and its owner, or
// ErrNotFound. Expiry is the caller's to check.
func (s *Store) TokenByHash(ctx context.Context, hash []byte) (Token, User, error) {
	var u User
	var uCreated int64
	row := s.db.QueryRowContext(ctx, `SELECT `+tokenCols+`, u.id, u.name, u.admin, u.created_at
		FROM tokens t JOIN users u ON u.id = t.user_id WHERE t.hash = $1`, hash)
	t, err := scanToken(row, &u.ID, &u.Name, &u.Admin, &uCreated)
	if err != nil {
		return Token{}, User{}, notFound(err, "token")
	}
	u.CreatedAt = fromNanos(uCreated)
	return t, u, nil
}

// TokenByID returns the token (or session) with this id, or ErrNotFound.
func (s *Store) TokenByID(ctx context.Context, id string) (Token, error) {
	t, err := scanToken(s.db.QueryRowContext(ctx, `SELECT `+tokenCols+` FROM tokens t WHERE t.id = $1`, id))
	return t, notFound(err, "token "+id)
}

// TouchToken records that the token was used at `at`.
func (s *Store) TouchToken(ctx context.Context, id string, at time.Time) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `UPDATE tokens SET last_used_at = $1 WHERE id = $2`, nanos(at), id)
		return mustAffect(res, err, "token "+id)
	})
}

// ListTokens returns personal access tokens (sessions are not listed),
// newest first; userID "" lists every user's.
func (s *Store) ListTokens(ctx context.Context, userID string) ([]Token, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+tokenCols+` FROM tokens t
		WHERE t.kind = $1 AND ($2 = '' OR t.user_id = $2)
		ORDER BY t.created_at DESC, t.id DESC`, TokenKindPAT, userID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Token
	for rows.Next() {
		t, err := scanToken(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, t)
	}
	return out, rows.Err()
}

// RevokeToken deletes the personal access token and, with it, every session
// it opened. With userID set, only that user's token matches, so a user
// cannot learn whether someone else's id exists: both read as ErrNotFound.
func (s *Store) RevokeToken(ctx context.Context, id, userID string) error {
	return s.revoke(ctx, id, userID, TokenKindPAT)
}

// RevokeSession deletes the session, scoped like RevokeToken.
func (s *Store) RevokeSession(ctx context.Context, id, userID string) error {
	return s.revoke(ctx, id, userID, TokenKindSession)
}

func (s *Store) revoke(ctx context.Context, id, userID, kind string) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM tokens WHERE id = $1 AND kind = $2 AND ($3 = '' OR user_id = $3)`, id, kind, userID)
		return mustAffect(res, err, kind+" "+id)
	})
}

// ListSessions returns console sessions with their user's name and the name
// of the token that opened each, newest first; userID "" lists every user's.
func (s *Store) ListSessions(ctx context.Context, userID string) ([]Session, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+tokenCols+`, u.name, p.name FROM tokens t
		JOIN tokens p ON p.id = t.parent_id
		JOIN users u ON u.id = t.user_id
		WHERE t.kind = $1 AND ($2 = '' OR t.user_id = $2)
		ORDER BY t.created_at DESC, t.id DESC`, TokenKindSession, userID)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Session
	for rows.Next() {
		var ses Session
		ses.Token, err = scanToken(rows, &ses.UserName, &ses.ParentName)
		if err != nil {
			return nil, err
		}
		out = append(out, ses)
	}
	return out, rows.Err()
}

// Session is a console session row, its user's name and the name of the
// token behind it.
type Session struct {
	Token
	UserName, ParentName string
}
