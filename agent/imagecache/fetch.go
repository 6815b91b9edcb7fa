package imagecache

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	neturl "net/url"
	"time"

	"github.com/a73x/eitri/agent/permanent"
)

var errStalled = errors.New("image download stalled")

// errStartOver ends a request whose answer cannot continue the partial
// download, which has been emptied; the next request starts from byte 0.
var errStartOver = errors.New("download starts over")

// download fetches url into sha's partial download file, hashing the bytes
// as they are written, and returns the file's path and length once the
// whole image is there and its digest matches.
//
// A request cut short after it moved the download on by at least the stall
// floor is followed at once by one for the rest (HTTP Range, with If-Range
// so a changed image is sent whole instead). Any other failure returns, and
// what came is kept for the next call to resume, unless the failure is
// permanent, is this host's disk, or no caller wants the image any more
// (the flight's context ends with errUnwanted); then nothing is left.
func (c *Cache) download(ctx context.Context, url, sha string, progress func(done, total int64)) (string, int64, error) {
	u, err := neturl.Parse(url)
	if err != nil {
		return "", 0, permanent.Errorf("image url %q: %w", url, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return "", 0, permanent.Errorf("image url %q: scheme must be http or https", url)
	}
	p, err := c.openPartial(sha, url)
	if err != nil {
		return "", 0, err
	}
	if p.n > 0 && progress != nil {
		// Narration picks up where the last attempt left off.
		progress(p.n, p.rec.Total)
	}
	floor := max(c.minProgress, 1)
	redone := false // started over once because a resumed download did not match
	for {
		before := p.wrote
		err := c.fetchOnce(ctx, u, url, p, progress)
		if err == nil {
			got := p.sum()
			if got == sha {
				// Recorded as complete, so decoding that is cut short
				// (unattended, closed) can start again without a request.
				if err := p.checkpoint(); err != nil {
					p.discard()
					return "", p.n, &localError{err}
				}
				p.f.Close()
				return p.f.Name(), p.n, nil
			}
			if p.resumed && !redone {
				// The bytes kept may be of an image the server has since
				// changed without a validator saying so, or torn by a crash:
				// only a whole download can blame the server.
				redone = true
				if err := p.reset("the resumed download's sha256 did not match"); err != nil {
					p.discard()
					return "", 0, &localError{err}
				}
				continue
			}
			n := p.n
			p.discard()
			return "", n, permanent.Errorf("%w: want %s, got %s (GET %s, %d bytes)", ErrChecksumMismatch, sha, got, url, n)
		}
		if errors.Is(err, errStartOver) {
			continue
		}
		_, local := errors.AsType[*localError](err)
		if !local && !permanent.Is(err) && ctx.Err() == nil && p.wrote-before >= floor {
			c.log.Info("imagecache: download interrupted; asking for the rest", "sha256", sha, "url", u.Redacted(), "have", p.n, "err", err)
			continue
		}
		n := p.n
		if local || permanent.Is(err) || errors.Is(context.Cause(ctx), errUnwanted) {
			p.discard()
		} else {
			p.keep()
		}
		return "", n, err
	}
}

// fetchOnce makes one request for what p is missing (all of it, or the rest
// with Range) and appends the body to p. It returns errStartOver, with p
// emptied, when the answer cannot continue p.
func (c *Cache) fetchOnce(ctx context.Context, u *neturl.URL, url string, p *partial, progress func(done, total int64)) error {
	if p.rec.Total >= 0 && p.n == p.rec.Total {
		return nil // all there already; a crash came before it was used
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	// The watchdog runs from before the first dial: connecting, redirects
	// and headers must fit one stall window too. Each request gets its own.
	wd := newWatchdog(c.stall, c.minProgress, cancel)
	defer wd.stop()
	hdr := http.Header{}
	if p.n > 0 {
		hdr.Set("Range", fmt.Sprintf("bytes=%d-", p.n))
		if v := p.rec.validator(); v != "" {
			hdr.Set("If-Range", v)
		}
	}
	resp, hops, err := c.get(ctx, u, hdr)
	if err != nil {
		if cause := context.Cause(ctx); errors.Is(cause, errStalled) {
			return fmt.Errorf("GET %s: %w", url, cause)
		}
		if _, ok := errors.AsType[*RefusedAddressError](err); ok {
			return err // says it all, starting with "image_url:"
		}
		return fmt.Errorf("GET %s: %w", url, err)
	}
	defer resp.Body.Close()
	wd.progress()
	startOver := func(why string) error {
		if err := p.reset(why); err != nil {
			return &localError{err}
		}
		return errStartOver
	}
	total := int64(-1)
	switch code := resp.StatusCode; {
	case code == http.StatusPartialContent && p.n > 0:
		first, complete, err := contentRange(resp.Header.Get("Content-Range"))
		switch {
		case err != nil:
			return startOver("the server's answer to a resume has " + err.Error())
		case first != p.n:
			return startOver(fmt.Sprintf("the server resumed at byte %d, not %d", first, p.n))
		case complete >= 0 && p.rec.Total >= 0 && complete != p.rec.Total:
			return startOver(fmt.Sprintf("the image is now %d bytes, not %d", complete, p.rec.Total))
		}
		if why := p.rec.changed(resp); why != "" {
			return startOver("the image on the server changed: " + why)
		}
		total = p.rec.Total
		if complete >= 0 {
			total = complete
		}
		p.resumed = true
		c.log.Info("imagecache: resuming download", "sha256", p.sha, "url", u.Redacted(), "from", p.n, "total", total)
	case code == http.StatusOK:
		if p.n > 0 {
			why := "the server does not resume downloads (it sent the whole image)"
			if hdr.Get("If-Range") != "" {
				why = "the server sent the whole image again (it changed, or it does not resume downloads)"
			}
			if err := p.reset(why); err != nil {
				return &localError{err}
			}
		}
		total = resp.ContentLength // -1 when the server did not say
		p.rec.ETag, p.rec.LastModified, p.rec.Total = resp.Header.Get("ETag"), resp.Header.Get("Last-Modified"), total
	case code == http.StatusRequestedRangeNotSatisfiable && p.n > 0:
		return startOver(fmt.Sprintf("the server cannot send the image from byte %d", p.n))
	default:
		// The code and our own words for it only: the reason phrase is the
		// server's text, and this error reaches whoever named the URL.
		err := fmt.Errorf("GET %s: %s%s", url, statusText(code), afterRedirects(hops))
		// A 4xx names a request that will keep failing, except these two,
		// which say "not now".
		if code >= 400 && code < 500 && code != http.StatusRequestTimeout && code != http.StatusTooManyRequests {
			return permanent.Wrap(err)
		}
		return err
	}
	if c.maxBytes > 0 && total > c.maxBytes {
		return permanent.Errorf("%w: GET %s declares %d bytes, cap is %d", ErrTooLarge, url, total, c.maxBytes)
	}
	if (p.restarted || p.n == 0) && progress != nil {
		// Progress goes back only here, and at once: a count that resumed
		// from where the discarded bytes left it would be a lie. A fresh
		// download is reported here too, so its total is known from the
		// first byte rather than the first step.
		progress(p.n, total)
	}
	p.restarted = false

	var pw io.Writer
	var meter *progressWriter
	if progress != nil {
		meter = &progressWriter{done: p.n, marked: p.n, total: total,
			step: c.progressStep, every: c.progressEvery, now: time.Now, markedAt: time.Now(), report: progress}
		pw = meter
	}
	var body io.Reader = wd.reader(resp.Body)
	if c.maxBytes > 0 {
		// One byte over the cap is enough to know.
		body = io.LimitReader(body, c.maxBytes+1-p.n)
	}
	err = p.pump(body, func() { cancel(nil) }, pw)
	if err == nil && meter != nil {
		// The body's last bytes are rarely a whole step: say where it ended.
		meter.flush()
	}
	n := p.n
	if err != nil {
		if _, ok := errors.AsType[*localError](err); ok {
			return err
		}
		if cause := context.Cause(ctx); errors.Is(cause, errStalled) {
			return fmt.Errorf("GET %s: %w (after %d bytes)", url, cause, n)
		}
		if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
			return fmt.Errorf("GET %s: %w", url, err)
		}
		return fmt.Errorf("GET %s: body after %d bytes: %w", url, n, err)
	}
	if c.maxBytes > 0 && n > c.maxBytes {
		return permanent.Errorf("%w: GET %s is over %d bytes", ErrTooLarge, url, c.maxBytes)
	}
	if total >= 0 && n != total {
		return fmt.Errorf("GET %s: body ends at %d bytes, Content-Length said %d", url, n, total)
	}
	return nil
}

// progressWriter counts the bytes that pass it and reports once a step's
// worth has passed, or once every (if set) has passed since the last report
// and the count moved. It stores nothing; the download's writer hands it
// each chunk it wrote.
type progressWriter struct {
	total, step  int64
	done, marked int64
	every        time.Duration
	now          func() time.Time
	markedAt     time.Time
	report       func(done, total int64)
}

func (w *progressWriter) Write(p []byte) (int, error) {
	w.done += int64(len(p))
	due := w.done-w.marked >= w.step
	if !due && w.every > 0 && w.done > w.marked {
		// Asked only per write (about one a MiB), never per byte.
		due = w.now().Sub(w.markedAt) >= w.every
	}
	if due {
		w.marked = w.done
		if w.every > 0 {
			w.markedAt = w.now()
		}
		w.report(w.done, w.total)
	}
	return len(p), nil
}

// flush reports the count if it moved since the last report: called once
// the body has ended, so the last report says where it ended.
func (w *progressWriter) flush() {
	if w.done > w.marked {
		w.marked = w.done
		w.report(w.done, w.total)
	}
}
