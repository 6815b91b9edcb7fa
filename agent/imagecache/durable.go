package imagecache

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
)

// fsync is (*os.File).Sync; a test swaps it to see what is synced.
var fsync = (*os.File).Sync

// syncDir makes the entries of dir (renames and removals in it) durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	defer d.Close()
	if err := fsync(d); err != nil {
		return fmt.Errorf("image cache: sync %s: %w", dir, err)
	}
	return nil
}

// syncFile flushes the file at path to disk.
func syncFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	defer f.Close()
	if err := fsync(f); err != nil {
		return fmt.Errorf("image cache: sync %s: %w", path, err)
	}
	return nil
}

// writeFileSynced replaces path with data through a synced temp file. The
// directory is not synced: callers that need the entry itself durable say so.
func writeFileSynced(path string, data []byte) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".*.part")
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if _, err = f.Write(data); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	if err = fsync(f); err != nil {
		return fmt.Errorf("image cache: sync %s: %w", f.Name(), err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	if err = os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	return nil
}

// verifiedRecord is <sha>.verified: what a finished image was when it was
// placed. It is written, and made durable, before the image is renamed into
// place, so an image without one was not placed by this code (an older agent
// that did not sync) and must prove itself.
//
// Size is the check: after a power loss a file can exist with a length but
// not its data only if it was never synced, and images are synced before
// their record is written. mtime is no use here, as it is the eviction
// clock (every hit moves it).
type verifiedRecord struct {
	Size   int64  `json:"size"`
	Format Format `json:"format"`
}

func (c *Cache) verifiedPath(sha string) string { return filepath.Join(c.dir, sha+".verified") }

// place renames the finished raw image at src to final, durably: src is
// synced, then its record written, then the rename made, with the directory
// synced after each step, so after any crash final is either absent or
// whole and described by its record.
func (c *Cache) place(src, sha string, format Format) error {
	if err := syncFile(src); err != nil {
		return err
	}
	fi, err := os.Stat(src)
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	data, _ := json.Marshal(verifiedRecord{Size: fi.Size(), Format: format})
	if err := writeFileSynced(c.verifiedPath(sha), data); err != nil {
		return err
	}
	if err := syncDir(c.dir); err != nil {
		return err
	}
	if err := os.Rename(src, c.Path(sha)); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	return syncDir(c.dir)
}

// checkCached decides whether the image already at final can be used: its
// size must be what its record says. An image with no record (placed by an
// agent that did not sync) is re-hashed and kept only if it is the served
// bytes themselves (a raw image); a decoded one cannot be checked and is
// fetched again. It returns why the image is not to be trusted, or "".
func (c *Cache) checkCached(ctx context.Context, sha string) (string, error) {
	final := c.Path(sha)
	fi, err := os.Stat(final)
	if err != nil {
		return "", fmt.Errorf("image cache: %w", err)
	}
	data, err := os.ReadFile(c.verifiedPath(sha))
	switch {
	case err == nil:
		var rec verifiedRecord
		if json.Unmarshal(data, &rec) != nil {
			return "its record is unreadable", nil
		}
		if rec.Size != fi.Size() {
			return fmt.Sprintf("it is %d bytes, its record says %d (torn by a crash?)", fi.Size(), rec.Size), nil
		}
		return "", nil
	case !errors.Is(err, os.ErrNotExist):
		return "", fmt.Errorf("image cache: %w", err)
	}
	f, err := os.Open(final)
	if err != nil {
		return "", fmt.Errorf("image cache: %w", err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.CopyBuffer(h, ctxReader{ctx, f}, make([]byte, 1<<20)); err != nil {
		if ctx.Err() != nil {
			return "", err
		}
		return "", fmt.Errorf("image cache: %w", err)
	}
	if hex.EncodeToString(h.Sum(nil)) != sha {
		return "it has no record and is not the served bytes", nil
	}
	// Read back, not necessarily on disk yet (the agent restarted, the host
	// did not): sync it before vouching for it.
	if err := syncFile(final); err != nil {
		return "", err
	}
	data, _ = json.Marshal(verifiedRecord{Size: fi.Size(), Format: FormatRaw})
	if err := writeFileSynced(c.verifiedPath(sha), data); err != nil {
		return "", err
	}
	return "", syncDir(c.dir)
}

// ctxReader stops a long local read when ctx ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (r ctxReader) Read(p []byte) (int, error) {
	if err := r.ctx.Err(); err != nil {
		return 0, err
	}
	return r.r.Read(p)
}
