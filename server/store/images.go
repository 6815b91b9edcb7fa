package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"
)

// Image is a catalogue entry: a name VMs are created by, what it is, and
// where its digest is resolved from. Versions are read with it.
type Image struct {
	Name string
	// Properties.
	OS, OSVersion, Architecture, LoginUser, Description string
	MinDiskGB, MinMemMB                                 int64
	// Readiness is an ImageReadiness word; "" for the host's default.
	Readiness string
	// Where a refresh resolves the digest again: the image's URL, its SUMS
	// file and signature, the name the SUMS file lists it under, and the
	// OpenPGP keys pinned for the signature.
	URL, SumsURL, SumsSignatureURL, SumsFileName string
	Keyring                                      []byte
	// Current is the version VMs created by name get.
	Current              int64
	CreatedAt, UpdatedAt time.Time
	// Versions are the kept ones, newest first.
	Versions []ImageVersion
}

// CurrentVersion is the version Current names; ok is false for an entry
// whose versions were not read.
func (i Image) CurrentVersion() (ImageVersion, bool) {
	for _, v := range i.Versions {
		if v.Version == i.Current {
			return v, true
		}
	}
	return ImageVersion{}, false
}

// ImageVersion is one digest a name pointed at, and where it came from.
type ImageVersion struct {
	Version                   int64
	URL, SHA256, SHA512       string
	Size                      int64
	SumsURL, SumsSignatureURL string
	Signer                    string
	VerifiedAt                *time.Time
	AddedBy                   string
	CreatedAt                 time.Time
}

const imageCols = `name, os, os_version, architecture, login_user, min_disk_gb, min_mem_mb, description, readiness,
	url, sums_url, sums_signature_url, sums_file_name, keyring, current_version, created_at, updated_at`

const imageVersionCols = `version, url, sha256, sha512, size, sums_url, sums_signature_url, signer, verified_at, added_by, created_at`

func scanImage(row interface{ Scan(...any) error }) (Image, error) {
	var i Image
	var created, updated int64
	err := row.Scan(&i.Name, &i.OS, &i.OSVersion, &i.Architecture, &i.LoginUser, &i.MinDiskGB, &i.MinMemMB, &i.Description, &i.Readiness,
		&i.URL, &i.SumsURL, &i.SumsSignatureURL, &i.SumsFileName, &i.Keyring, &i.Current, &created, &updated)
	if err != nil {
		return Image{}, err
	}
	i.CreatedAt, i.UpdatedAt = fromNanos(created), fromNanos(updated)
	return i, nil
}

func scanImageVersion(row interface{ Scan(...any) error }) (ImageVersion, error) {
	var v ImageVersion
	var verified sql.NullInt64
	var created int64
	err := row.Scan(&v.Version, &v.URL, &v.SHA256, &v.SHA512, &v.Size, &v.SumsURL, &v.SumsSignatureURL, &v.Signer, &verified, &v.AddedBy, &created)
	if err != nil {
		return ImageVersion{}, err
	}
	v.VerifiedAt, v.CreatedAt = fromNullNanos(verified), fromNanos(created)
	return v, nil
}

func insertImageVersion(ctx context.Context, tx *sql.Tx, name string, v ImageVersion) error {
	_, err := tx.ExecContext(ctx, `INSERT INTO image_versions (name, `+imageVersionCols+`)
		VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)`,
		name, v.Version, v.URL, v.SHA256, v.SHA512, v.Size, v.SumsURL, v.SumsSignatureURL, v.Signer, nullNanos(v.VerifiedAt), v.AddedBy, nanos(v.CreatedAt))
	return err
}

// CreateImage adds a name with its first version (numbered 1). ErrConflict
// when the name is taken.
func (s *Store) CreateImage(ctx context.Context, img Image, first ImageVersion) error {
	if img.Name == "" || first.SHA256 == "" || first.URL == "" {
		return errors.New("store: an image needs a name, a URL and a digest")
	}
	img.CreatedAt = s.orNow(img.CreatedAt)
	img.UpdatedAt = img.CreatedAt
	first.Version, img.Current = 1, 1
	first.CreatedAt = img.CreatedAt
	return s.write(ctx, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `INSERT INTO images (`+imageCols+`)
			VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)`,
			img.Name, img.OS, img.OSVersion, img.Architecture, img.LoginUser, img.MinDiskGB, img.MinMemMB, img.Description, img.Readiness,
			img.URL, img.SumsURL, img.SumsSignatureURL, img.SumsFileName, img.Keyring, img.Current, nanos(img.CreatedAt), nanos(img.UpdatedAt))
		if isUniqueViolation(err) {
			return fmt.Errorf("%w: an image named %q is already in the catalogue", ErrConflict, img.Name)
		}
		if err != nil {
			return err
		}
		// Versions left by an earlier entry of the same name are not this
		// one's.
		if _, err := tx.ExecContext(ctx, `DELETE FROM image_versions WHERE name = $1`, img.Name); err != nil {
			return err
		}
		return insertImageVersion(ctx, tx, img.Name, first)
	})
}

func getImage(ctx context.Context, q queryer, name string) (Image, error) {
	img, err := scanImage(q.QueryRowContext(ctx, `SELECT `+imageCols+` FROM images WHERE name = $1`, name))
	if err != nil {
		return Image{}, notFound(err, "image "+name)
	}
	img.Versions, err = imageVersions(ctx, q, name)
	return img, err
}

func imageVersions(ctx context.Context, q queryer, name string) ([]ImageVersion, error) {
	rows, err := q.QueryContext(ctx, `SELECT `+imageVersionCols+` FROM image_versions WHERE name = $1 ORDER BY version DESC`, name)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []ImageVersion
	for rows.Next() {
		v, err := scanImageVersion(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// Image returns a catalogue entry with its versions, or ErrNotFound.
func (s *Store) Image(ctx context.Context, name string) (Image, error) {
	return getImage(ctx, s.db, name)
}

// ListImages returns every entry with its versions, by name.
func (s *Store) ListImages(ctx context.Context) ([]Image, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+imageCols+` FROM images ORDER BY name`)
	if err != nil {
		return nil, err
	}
	var out []Image
	for rows.Next() {
		img, err := scanImage(rows)
		if err != nil {
			rows.Close()
			return nil, err
		}
		out = append(out, img)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	for i := range out {
		if out[i].Versions, err = imageVersions(ctx, s.db, out[i].Name); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// DeleteImage removes a name and its versions, or says ErrNotFound.
func (s *Store) DeleteImage(ctx context.Context, name string) error {
	return s.write(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM images WHERE name = $1`, name)
		if err := mustAffect(res, err, "image "+name); err != nil {
			return err
		}
		if _, err = tx.ExecContext(ctx, `DELETE FROM image_versions WHERE name = $1`, name); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `DELETE FROM image_pulls WHERE name = $1`, name)
		return err
	})
}

// AddImagePulls records that name is to be held on each of hosts (again
// is no change). ErrNotFound when the name is not in the catalogue.
func (s *Store) AddImagePulls(ctx context.Context, name string, hosts []string) error {
	now := nanos(s.now())
	return s.write(ctx, func(tx *sql.Tx) error {
		var n int
		if err := tx.QueryRowContext(ctx, `SELECT COUNT(*) FROM images WHERE name = $1`, name).Scan(&n); err != nil {
			return err
		}
		if n == 0 {
			return fmt.Errorf("%w: image %s", ErrNotFound, name)
		}
		for _, h := range hosts {
			if _, err := tx.ExecContext(ctx, `INSERT INTO image_pulls (name, host_id, created_at) VALUES ($1, $2, $3)
				ON CONFLICT (name, host_id) DO NOTHING`, name, h, now); err != nil {
				return err
			}
		}
		return nil
	})
}

func stringColumn(ctx context.Context, q queryer, query string, args ...any) ([]string, error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// ImagePullHosts lists the hosts name was pulled to.
func (s *Store) ImagePullHosts(ctx context.Context, name string) ([]string, error) {
	return stringColumn(ctx, s.db, `SELECT host_id FROM image_pulls WHERE name = $1 ORDER BY host_id`, name)
}

// ImagePullsForHost lists the images pulled to host, by name.
func (s *Store) ImagePullsForHost(ctx context.Context, hostID string) ([]string, error) {
	return stringColumn(ctx, s.db, `SELECT name FROM image_pulls WHERE host_id = $1 ORDER BY name`, hostID)
}

// AdvanceImage points name at v when v's digest differs from the current
// version's, numbering it one past the newest and keeping the newest keep
// versions; with the same digest it only refreshes the current version's
// provenance (a refresh that found nothing new still verified it). url
// becomes the entry's URL either way. changed says whether the name moved.
func (s *Store) AdvanceImage(ctx context.Context, name string, v ImageVersion, keep int) (img Image, changed bool, err error) {
	if keep < 1 {
		keep = 1
	}
	now := s.now()
	err = s.write(ctx, func(tx *sql.Tx) error {
		changed = false
		cur, err := getImage(ctx, tx, name)
		if err != nil {
			return err
		}
		old, _ := cur.CurrentVersion()
		if old.SHA256 == v.SHA256 {
			_, err = tx.ExecContext(ctx, `UPDATE image_versions SET sums_url = $3, sums_signature_url = $4, signer = $5, verified_at = $6, url = $7
				WHERE name = $1 AND version = $2`, name, cur.Current, v.SumsURL, v.SumsSignatureURL, v.Signer, nullNanos(v.VerifiedAt), v.URL)
			if err != nil {
				return err
			}
		} else {
			newest := cur.Current
			for _, kept := range cur.Versions {
				newest = max(newest, kept.Version)
			}
			v.Version, v.CreatedAt = newest+1, now
			if err := insertImageVersion(ctx, tx, name, v); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, `DELETE FROM image_versions WHERE name = $1 AND version <= $2`, name, v.Version-int64(keep)); err != nil {
				return err
			}
			cur.Current, changed = v.Version, true
		}
		if _, err := tx.ExecContext(ctx, `UPDATE images SET current_version = $2, url = $3, updated_at = $4 WHERE name = $1`,
			name, cur.Current, v.URL, nanos(now)); err != nil {
			return err
		}
		img, err = getImage(ctx, tx, name)
		return err
	})
	return img, changed, err
}
