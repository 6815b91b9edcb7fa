package imagecache

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"

	"github.com/klauspost/compress/gzip"

	"github.com/a73x/eitri/agent/permanent"
)

const (
	qcow2Magic = "QFI\xfb"
	gzipMagic  = "\x1f\x8b"
)

// Format is what the downloaded bytes turned out to be.
type Format string

const (
	FormatRaw   Format = "raw"
	FormatGzip  Format = "gzip"
	FormatQcow2 Format = "qcow2"
)

// materialize turns the verified download at src into sha's raw image in
// the cache. The result is placed durably (see place), so the image either
// does not exist or is complete and recorded.
func (c *Cache) materialize(ctx context.Context, src, sha string) (Format, error) {
	f, err := os.Open(src)
	if err != nil {
		return "", fmt.Errorf("image cache: %w", err)
	}
	defer f.Close()
	head := make([]byte, 4)
	n, _ := io.ReadFull(f, head)
	head = head[:n]

	switch {
	case bytes.HasPrefix(head, []byte(qcow2Magic)):
		return FormatQcow2, c.writeAtomically(sha, FormatQcow2, func(out *os.File) error {
			fi, err := f.Stat()
			if err != nil {
				return fmt.Errorf("image cache: %w", err)
			}
			return DecodeQcow2(ctx, f, fi.Size(), out)
		})
	case bytes.HasPrefix(head, []byte(gzipMagic)):
		if _, err := f.Seek(0, io.SeekStart); err != nil {
			return "", err
		}
		return FormatGzip, c.writeAtomically(sha, FormatGzip, func(out *os.File) error {
			return gunzipSparse(ctx, f, out)
		})
	default:
		// Already raw: the download is the image.
		if err := c.checkCap(src); err != nil {
			return "", err
		}
		return FormatRaw, c.place(src, sha, FormatRaw)
	}
}

// writeAtomically runs fill on a fresh temp file and places it as sha's
// image (durably, see place), removing it on any failure.
func (c *Cache) writeAtomically(sha string, format Format, fill func(*os.File) error) (err error) {
	out, err := os.CreateTemp(c.dir, sha+".*.raw.part")
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	defer func() {
		if err != nil {
			out.Close()
			os.Remove(out.Name())
		}
	}()
	if err := fill(out); err != nil {
		return err
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	if err := c.checkCap(out.Name()); err != nil {
		return err
	}
	return c.place(out.Name(), sha, format)
}

// checkCap refuses an image that could never fit, however much is evicted.
func (c *Cache) checkCap(path string) error {
	if c.maxBytes <= 0 {
		return nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	if a := allocated(fi); a > c.maxBytes {
		return permanent.Errorf("%w: raw image takes %d bytes on disk, cap is %d", ErrTooLarge, a, c.maxBytes)
	}
	return nil
}

// gunzipSparse decompresses a gzipped raw image into out, leaving holes where
// the image is zero. A gzipped qcow2 is refused: decompressing it yields a
// container, not a disk, and booting that would fail in a confusing way.
func gunzipSparse(ctx context.Context, in io.Reader, out *os.File) error {
	zr, err := gzip.NewReader(in)
	if err != nil {
		return permanent.Errorf("%w: gzip: %w", ErrCorrupt, err)
	}
	defer zr.Close()
	sw := newSparseWriter(out)
	buf := make([]byte, 1<<20)
	first := true
	for {
		if err := ctx.Err(); err != nil {
			return err
		}
		// Fill the buffer whole so zero runs are judged on large blocks;
		// io.ReadFull would blur a truncated stream into a short read.
		n := 0
		var rerr error
		for n < len(buf) && rerr == nil {
			var m int
			m, rerr = zr.Read(buf[n:])
			n += m
		}
		if first && n > 0 {
			first = false
			if bytes.HasPrefix(buf[:n], []byte(qcow2Magic)) {
				return permanent.Errorf("%w: gzip wraps a qcow2 image; serve the qcow2 itself (it compresses internally)", ErrUnsupported)
			}
		}
		if n > 0 {
			if err := sw.write(buf[:n]); err != nil {
				return err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return permanent.Errorf("%w: gzip: %w", ErrCorrupt, rerr)
		}
	}
	return sw.finish()
}
