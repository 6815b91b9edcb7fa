package imagecache

import (
	"crypto/sha256"
	"encoding"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// checkpointEvery is how many downloaded bytes pass between checkpoints (a
// sync of the partial download and its record), unless a sync outlasts
// them: the next starts when it ends. What a power loss can cost a resume
// is this plus what arrives during one sync.
const checkpointEvery = 64 << 20

// writebackEvery is how many written bytes may wait in the page cache before
// the kernel is asked to start putting them on disk.
const writebackEvery = 8 << 20

// startWriteback asks the kernel to start writing n bytes of f from off to
// disk, without waiting for it. It is only a head start for the fsync that
// makes them durable, so a failure is left for that fsync to report.
func startWriteback(f *os.File, off, n int64) {
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	_ = rc.Control(func(fd uintptr) {
		_ = unix.SyncFileRange(int(fd), off, n, unix.SYNC_FILE_RANGE_WRITE)
	})
}

// resumeRecord is <sha>.download.resume: how to ask for the rest of
// <sha>.download.part. Its first Synced bytes are on disk and Hash is the
// sha256 state over exactly them, so a resume needs neither a re-read of the
// file nor trust in anything past Synced (a power loss may leave garbage
// there).
type resumeRecord struct {
	// URL is the sha256 of the URL the bytes came from: enough to tell it
	// is the same, without keeping any credentials it carries on disk.
	URL          string `json:"url_sha256"`
	ETag         string `json:"etag,omitempty"`
	LastModified string `json:"last_modified,omitempty"`
	Total        int64  `json:"total"` // the whole image's length; -1 unknown
	Synced       int64  `json:"synced"`
	Hash         []byte `json:"sha256_state,omitempty"`
}

// validator is what If-Range carries: a strong ETag, else the date.
func (r *resumeRecord) validator() string {
	if r.ETag != "" && !strings.HasPrefix(r.ETag, "W/") {
		return r.ETag
	}
	return r.LastModified
}

// changed says why resp does not describe the bytes r describes, or "".
func (r *resumeRecord) changed(resp *http.Response) string {
	if e := resp.Header.Get("ETag"); e != "" && r.ETag != "" && e != r.ETag {
		return "its ETag changed"
	}
	if m := resp.Header.Get("Last-Modified"); m != "" && r.LastModified != "" && m != r.LastModified {
		return "its Last-Modified changed"
	}
	return ""
}

func urlKey(url string) string {
	s := sha256.Sum256([]byte(url))
	return hex.EncodeToString(s[:])
}

func (c *Cache) partPath(sha string) string   { return filepath.Join(c.dir, sha+".download.part") }
func (c *Cache) resumePath(sha string) string { return filepath.Join(c.dir, sha+".download.resume") }

// partial is the served bytes of one image fetched so far, with the running
// sha256 of exactly those bytes. While pump runs, the file and the hash move
// on separate goroutines; they agree again whenever it returns (unless a
// write failed: then broken is set and the partial is only discarded) and
// at every checkpoint it makes.
type partial struct {
	c        *Cache
	sha, url string
	f        *os.File
	h        hash.Hash
	n        int64 // bytes in f, all hashed once pump returns
	wrote    int64 // bytes written ever, across restarts: how far requests moved it
	rec      resumeRecord
	resumed  bool // bytes from an earlier request are kept: a resume happened
	unsynced int64
	// every is how many bytes may pass between checkpoints: checkpointEvery
	// but in tests.
	every int64
	// kicked is where the last writeback request ended.
	kicked int64
	// restarted: the download started over since progress was last told;
	// the next answer tells it so, from 0.
	restarted bool
	// broken: a write failed while the hash went on; the file and the hash
	// no longer describe the same bytes, so this is never recorded.
	broken bool
}

// openPartial opens sha's partial download, picking up what an earlier
// attempt (in this process or before a restart) left, if its record says it
// came from url; otherwise it starts empty.
func (c *Cache) openPartial(sha, url string) (*partial, error) {
	f, err := os.OpenFile(c.partPath(sha), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("image cache: %w", err)
	}
	p := &partial{c: c, sha: sha, url: url, f: f, h: sha256.New(), every: checkpointEvery}
	why := p.pickUp()
	if p.n == 0 {
		if why != "" {
			c.log.Info("imagecache: not resuming the partial download", "sha256", sha, "why", why)
		}
		if err := p.reset(""); err != nil {
			f.Close()
			return nil, err
		}
		return p, nil
	}
	c.log.Info("imagecache: resuming a partial download", "sha256", sha, "have", p.n, "total", p.rec.Total)
	return p, nil
}

// pickUp adopts the partial file's record if it can; why it could not, if
// there was something to pick up.
func (p *partial) pickUp() string {
	data, err := os.ReadFile(p.c.resumePath(p.sha))
	if err != nil {
		return ""
	}
	var rec resumeRecord
	switch {
	case json.Unmarshal(data, &rec) != nil:
		return "its record is unreadable"
	case rec.URL != urlKey(p.url):
		return "it came from another URL"
	case rec.Synced <= 0:
		return ""
	}
	fi, err := p.f.Stat()
	if err != nil || fi.Size() < rec.Synced {
		return "it is shorter than its record says"
	}
	if err := p.h.(encoding.BinaryUnmarshaler).UnmarshalBinary(rec.Hash); err != nil {
		return "its hash state is unreadable"
	}
	// Anything past Synced may be what a power loss left; it is fetched again.
	if err := p.f.Truncate(rec.Synced); err != nil {
		p.h.Reset()
		return err.Error()
	}
	p.n, p.kicked, p.rec, p.resumed = rec.Synced, rec.Synced, rec, true
	return ""
}

// reset empties the partial download to start over; why, when not "", is
// logged and kept for the error that might follow.
func (p *partial) reset(why string) error {
	if why != "" {
		p.restarted = true
		p.c.log.Warn("imagecache: download starts over", "sha256", p.sha, "had", p.n, "why", why)
	}
	p.h.Reset()
	p.n, p.unsynced, p.kicked, p.resumed = 0, 0, 0, false
	p.rec = resumeRecord{URL: urlKey(p.url), Total: -1}
	p.broken = false
	if err := p.f.Truncate(0); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	return nil
}

// localError is a failure of this host's disk, not of the download.
type localError struct{ err error }

func (e *localError) Error() string { return "image cache: " + e.err.Error() }
func (e *localError) Unwrap() error { return e.err }

// write appends b to the file, leaving zero blocks as holes (a raw
// download is the image, and disk images are often mostly zeros), and asks
// the kernel to start writing each writebackEvery bytes out at once, so the
// disk works while the download goes on rather than all at the next
// checkpoint. The hash is not touched: the download pipeline hashes on a
// goroutine of its own (see pump).
func (p *partial) write(b []byte) error {
	if err := putNonZero(p.f, b, p.n); err != nil {
		return err
	}
	p.n += int64(len(b))
	p.wrote += int64(len(b))
	p.unsynced += int64(len(b))
	if p.n-p.kicked >= writebackEvery {
		startWriteback(p.f, p.kicked, p.n-p.kicked)
		p.kicked = p.n
	}
	return nil
}

// extend makes the file p.n bytes long: a zero tail written as a hole
// left it shorter.
func (p *partial) extend() error {
	fi, err := p.f.Stat()
	if err != nil {
		return err
	}
	if fi.Size() < p.n {
		return p.f.Truncate(p.n)
	}
	return nil
}

// checkpoint makes everything written so far durable and records it, so a
// resume after a crash starts from here. The hash must be over exactly the
// bytes written.
func (p *partial) checkpoint() error {
	if p.broken {
		return errors.New("the partial download's hash and file disagree")
	}
	state, err := p.h.(encoding.BinaryMarshaler).MarshalBinary()
	if err != nil {
		return err
	}
	if err := p.extend(); err != nil {
		return err
	}
	if err := p.record(p.rec, p.n, state); err != nil {
		return err
	}
	p.rec.Synced, p.rec.Hash = p.n, state
	p.unsynced = 0
	return nil
}

// record syncs the file, then writes rec saying its first n bytes are on
// disk and state is the sha256 state over exactly them. It changes nothing
// in p, so it may run while p's writer goes on past n.
func (p *partial) record(rec resumeRecord, n int64, state []byte) error {
	if err := fsync(p.f); err != nil {
		return err
	}
	rec.Synced, rec.Hash = n, state
	data, _ := json.Marshal(rec)
	return writeFileSynced(p.c.resumePath(p.sha), data)
}

// sum is the hex sha256 of the bytes so far.
func (p *partial) sum() string { return hex.EncodeToString(p.h.Sum(nil)) }

// keep closes the partial download, leaving it to be resumed. Nothing
// worth resuming (no bytes) is removed instead.
func (p *partial) keep() {
	if p.n == 0 {
		p.discard()
		return
	}
	if err := p.checkpoint(); err != nil {
		p.c.log.Warn("imagecache: cannot keep a partial download to resume", "sha256", p.sha, "err", err)
		p.discard()
		return
	}
	p.f.Close()
}

// discard closes and removes the partial download and its record.
func (p *partial) discard() {
	p.f.Close()
	p.c.removePartial(p.sha)
}

func (c *Cache) removePartial(sha string) {
	os.Remove(c.partPath(sha))
	os.Remove(c.resumePath(sha))
}

// contentRange parses a 206's "bytes first-last/complete"; complete is -1
// for "*".
func contentRange(s string) (first, complete int64, err error) {
	spec, ok := strings.CutPrefix(s, "bytes ")
	rng, all, ok2 := strings.Cut(spec, "/")
	firstS, _, ok3 := strings.Cut(rng, "-")
	if !ok || !ok2 || !ok3 {
		return 0, 0, errors.New("malformed Content-Range")
	}
	if first, err = strconv.ParseInt(firstS, 10, 64); err != nil || first < 0 {
		return 0, 0, errors.New("malformed Content-Range")
	}
	if all == "*" {
		return first, -1, nil
	}
	if complete, err = strconv.ParseInt(all, 10, 64); err != nil || complete < 0 {
		return 0, 0, errors.New("malformed Content-Range")
	}
	return first, complete, nil
}
