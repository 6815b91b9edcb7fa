package imagecache

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	neturl "net/url"
	"os"
	"sync"
)

var errStalled = errors.New("image download stalled")

// download fetches url into a temp file in the cache dir, hashing the bytes
// as they are written. It returns the temp path (the caller removes or
// renames it) and the byte count. On error nothing is left on disk.
func (c *Cache) download(ctx context.Context, url, sha string, progress func(done, total int64)) (string, int64, error) {
	u, err := neturl.Parse(url)
	if err != nil {
		return "", 0, permanentf("image url %q: %w", url, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", 0, permanentf("image url %q: scheme must be http or https", url)
	}

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// The watchdog runs from before the first dial: connecting, redirects
	// and headers must fit one stall window too.
	wd := newWatchdog(c.stall, c.minProgress, cancel)
	defer wd.stop()
	resp, hops, err := c.get(ctx, u)
	if err != nil {
		if cause := context.Cause(ctx); errors.Is(cause, errStalled) {
			return "", 0, fmt.Errorf("GET %s: %w", url, cause)
		}
		if _, ok := errors.AsType[*RefusedAddressError](err); ok {
			return "", 0, err // says it all, starting with "image_url:"
		}
		return "", 0, fmt.Errorf("GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	wd.progress()
	if resp.StatusCode != http.StatusOK {
		// The code and our own words for it only: the reason phrase is the
		// server's text, and this error reaches whoever named the URL.
		err := fmt.Errorf("GET %s: %s%s", url, statusText(resp.StatusCode), afterRedirects(hops))
		// A 4xx names a request that will keep failing, except these two,
		// which say "not now".
		if resp.StatusCode >= 400 && resp.StatusCode < 500 &&
			resp.StatusCode != http.StatusRequestTimeout && resp.StatusCode != http.StatusTooManyRequests {
			return "", 0, permanent(err)
		}
		return "", 0, err
	}
	total := resp.ContentLength // -1 when the server did not say
	if c.maxBytes > 0 && total > c.maxBytes {
		return "", 0, permanentf("%w: GET %s declares %d bytes, cap is %d", ErrTooLarge, url, total, c.maxBytes)
	}

	tmp, err := os.CreateTemp(c.dir, sha+".*.download.part")
	if err != nil {
		return "", 0, fmt.Errorf("image cache: %w", err)
	}
	ok := false
	defer func() {
		if !ok {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()

	h := sha256.New()
	sinks := []io.Writer{tmp, h}
	if progress != nil {
		sinks = append(sinks, &progressWriter{total: total, step: c.progressStep, report: progress})
	}
	var body io.Reader = wd.reader(resp.Body)
	if c.maxBytes > 0 {
		// One byte over the cap is enough to know.
		body = io.LimitReader(body, c.maxBytes+1)
	}
	n, err := pipeCopy(io.MultiWriter(sinks...), body, func() { cancel(nil) })
	if err != nil {
		if cause := context.Cause(ctx); errors.Is(cause, errStalled) {
			return "", n, fmt.Errorf("GET %s: %w (after %d bytes)", url, cause, n)
		}
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return "", n, fmt.Errorf("GET %s: %w", url, err)
		}
		return "", n, fmt.Errorf("GET %s: body after %d bytes: %w", url, n, err)
	}
	if c.maxBytes > 0 && n > c.maxBytes {
		return "", n, permanentf("%w: GET %s is over %d bytes", ErrTooLarge, url, c.maxBytes)
	}
	if total >= 0 && n != total {
		return "", n, fmt.Errorf("GET %s: body is %d bytes, Content-Length said %d", url, n, total)
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != sha {
		return "", n, permanentf("%w: want %s, got %s (GET %s, %d bytes)", ErrChecksumMismatch, sha, got, url, n)
	}
	if err := tmp.Close(); err != nil {
		return "", n, fmt.Errorf("image cache: %w", err)
	}
	ok = true
	return tmp.Name(), n, nil
}

// progressWriter counts the bytes that pass it and reports at most once per
// step. It stores nothing; it rides the MultiWriter beside the file and hash.
type progressWriter struct {
	total, step  int64
	done, marked int64
	report       func(done, total int64)
}

func (w *progressWriter) Write(p []byte) (int, error) {
	w.done += int64(len(p))
	if w.done-w.marked >= w.step {
		w.marked = w.done
		w.report(w.done, w.total)
	}
	return len(p), nil
}

// pipeCopy copies src to dst with the reading on its own goroutine, so the
// network receive overlaps hashing and writing instead of alternating with
// them. Buffers are large to keep syscalls and hash calls few. abort must
// unblock a pending src.Read; it is called when dst fails, so the reader can
// be waited for rather than left running.
func pipeCopy(dst io.Writer, src io.Reader, abort func()) (int64, error) {
	const nbuf, size = 4, 1 << 20
	free := make(chan []byte, nbuf)
	for range nbuf {
		free <- make([]byte, size)
	}
	type chunk struct {
		b   []byte
		err error
	}
	full := make(chan chunk, nbuf)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(full)
		for {
			var buf []byte
			select {
			case buf = <-free:
			case <-stop:
				return
			}
			// Fill most of the buffer before handing it over; a lone
			// short read would waste the batching.
			n := 0
			var err error
			for n < len(buf)/2 && err == nil {
				var m int
				m, err = src.Read(buf[n:])
				n += m
			}
			select {
			case full <- chunk{buf[:n], err}:
			case <-stop:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	defer wg.Wait()
	defer close(stop)

	var written int64
	for c := range full {
		if len(c.b) > 0 {
			m, err := dst.Write(c.b)
			written += int64(m)
			if err != nil {
				abort()
				return written, err
			}
		}
		if c.err == io.EOF {
			return written, nil
		}
		if c.err != nil {
			return written, c.err
		}
		free <- c.b[:cap(c.b)]
	}
	return written, nil
}
