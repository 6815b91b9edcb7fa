package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// Release is one signed agent build the control plane can hand out. Its
// bytes are read apart (ReleaseData): listings never carry them.
type Release struct {
	SHA256, Version, OS, Arch string
	Size                      int64
	// KeyID names the key that signed it; Signature is the signature file
	// the agent checks.
	KeyID      string
	Signature  []byte
	UploadedBy string
	UploadedAt time.Time
}

const releaseCols = `sha256, version, os, arch, size, key_id, signature, uploaded_by, uploaded_at`

func scanRelease(row interface{ Scan(...any) error }) (Release, error) {
	var r Release
	var at int64
	if err := row.Scan(&r.SHA256, &r.Version, &r.OS, &r.Arch, &r.Size, &r.KeyID, &r.Signature, &r.UploadedBy, &at); err != nil {
		return Release{}, err
	}
	r.UploadedAt = fromNanos(at)
	return r, nil
}

// CreateRelease stores a build. ErrConflict: the same bytes are already
// held, or another build already claims its version and platform.
func (s *Store) CreateRelease(ctx context.Context, r Release, data []byte) error {
	if r.SHA256 == "" || int64(len(data)) != r.Size {
		return errors.New("store: a release needs its sha256 and exactly its bytes")
	}
	return s.write(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO releases (`+releaseCols+`, data) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)`,
			r.SHA256, r.Version, r.OS, r.Arch, r.Size, r.KeyID, r.Signature, r.UploadedBy, nanos(s.orNow(r.UploadedAt)), data)
		if isUniqueViolation(err) {
			return fmt.Errorf("%w: a build of %s for %s/%s (or these very bytes) is already held", ErrConflict, r.Version, r.OS, r.Arch)
		}
		return err
	})
}

// ListReleases returns every build, newest upload first.
func (s *Store) ListReleases(ctx context.Context) ([]Release, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+releaseCols+` FROM releases ORDER BY uploaded_at DESC, sha256`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Release
	for rows.Next() {
		r, err := scanRelease(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, r)
	}
	return out, rows.Err()
}

// ReleaseBySHA256 returns one build, or ErrNotFound.
func (s *Store) ReleaseBySHA256(ctx context.Context, sha string) (Release, error) {
	r, err := scanRelease(s.db.QueryRowContext(ctx, `SELECT `+releaseCols+` FROM releases WHERE sha256 = $1`, sha))
	return r, notFound(err, "release "+sha)
}

// ReleaseFor returns the build of version for a platform, or ErrNotFound.
func (s *Store) ReleaseFor(ctx context.Context, version, os, arch string) (Release, error) {
	r, err := scanRelease(s.db.QueryRowContext(ctx, `SELECT `+releaseCols+` FROM releases WHERE version = $1 AND os = $2 AND arch = $3`,
		version, os, arch))
	return r, notFound(err, fmt.Sprintf("release %s for %s/%s", version, os, arch))
}

// ReleaseData returns a build's bytes, or ErrNotFound.
func (s *Store) ReleaseData(ctx context.Context, sha string) ([]byte, error) {
	var data []byte
	err := s.db.QueryRowContext(ctx, `SELECT data FROM releases WHERE sha256 = $1`, sha).Scan(&data)
	return data, notFound(err, "release "+sha)
}

// DeleteRelease forgets a build, or says ErrNotFound.
func (s *Store) DeleteRelease(ctx context.Context, sha string) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM releases WHERE sha256 = $1`, sha)
		return mustAffect(res, err, "release "+sha)
	})
}
