package imagecache

import (
	"bytes"
	"fmt"
	"os"
)

// sparseBlock is the granularity at which zeros become holes: the usual
// filesystem block, so a hole is never smaller than what the disk can skip.
const sparseBlock = 4096

var zeroBlock = make([]byte, 1<<20)

// isZero reports whether p is all zero bytes. bytes.Equal runs the
// vectorised memequal, far quicker than a byte loop.
func isZero(p []byte) bool {
	for len(p) > 0 {
		n := min(len(p), len(zeroBlock))
		if !bytes.Equal(p[:n], zeroBlock[:n]) {
			return false
		}
		p = p[n:]
	}
	return true
}

// writeSparseAt writes p at off, skipping every all-zero sparseBlock-aligned
// block so it stays a hole. The file must have been truncated to its full
// size beforehand (or be extended by finish), so skipped blocks read back as
// zeros.
func writeSparseAt(f *os.File, p []byte, off int64) error {
	if err := putNonZero(f, p, off); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	return nil
}

// putNonZero is writeSparseAt with the file's own error.
func putNonZero(f *os.File, p []byte, off int64) error {
	for len(p) > 0 {
		// End of this block, aligned to the file, not to p.
		n := sparseBlock - int(off%sparseBlock)
		n = min(n, len(p))
		// Coalesce consecutive non-zero blocks into one write.
		end := 0
		for end < len(p) {
			m := min(sparseBlock-int((off+int64(end))%sparseBlock), len(p)-end)
			if isZero(p[end : end+m]) {
				break
			}
			end += m
		}
		if end > 0 {
			if _, err := f.WriteAt(p[:end], off); err != nil {
				return err
			}
			p, off = p[end:], off+int64(end)
			continue
		}
		p, off = p[n:], off+int64(n)
	}
	return nil
}

// sparseWriter writes a stream sequentially, leaving holes for zero blocks.
type sparseWriter struct {
	f   *os.File
	off int64
}

func newSparseWriter(f *os.File) *sparseWriter { return &sparseWriter{f: f} }

func (w *sparseWriter) write(p []byte) error {
	if err := writeSparseAt(w.f, p, w.off); err != nil {
		return err
	}
	w.off += int64(len(p))
	return nil
}

// finish sets the length, covering a trailing hole that was never written.
func (w *sparseWriter) finish() error {
	if err := w.f.Truncate(w.off); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	return nil
}
