package imagecache

import (
	"os"
	"path/filepath"
	"strings"
	"time"
)

// partialMaxAge is how long a partial download nobody resumes is kept.
const partialMaxAge = 24 * time.Hour

// sweepPartials tidies the directory before this process first uses it:
// work files a process that died left behind go (their names are unique per
// attempt, so a leftover never collides with new work; this only returns the
// space), and so do records that lost their file. A partial download with
// its record is kept, to be resumed.
func (c *Cache) sweepPartials() {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return
	}
	have := map[string]bool{}
	for _, e := range ents {
		have[e.Name()] = true
	}
	for _, e := range ents {
		name := e.Name()
		var orphan bool
		switch {
		case strings.HasSuffix(name, ".download.part"):
			orphan = !validDigest(strings.TrimSuffix(name, ".download.part")) ||
				!have[strings.TrimSuffix(name, ".part")+".resume"]
		case strings.HasSuffix(name, ".part"):
			orphan = true
		case strings.HasSuffix(name, ".download.resume"):
			orphan = !have[strings.TrimSuffix(name, ".resume")+".part"]
		case strings.HasSuffix(name, ".verified"):
			orphan = !have[strings.TrimSuffix(name, ".verified")+".raw"]
		}
		if orphan {
			p := filepath.Join(c.dir, name)
			if err := os.Remove(p); err == nil {
				c.log.Info("imagecache: removed leftover work file", "path", p)
			}
		}
	}
}

// sweepStale removes partial downloads nobody has resumed for partialMaxAge
// (their VM went away while the download was stopped).
func (c *Cache) sweepStale() {
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, e := range ents {
		sha, ok := strings.CutSuffix(e.Name(), ".download.part")
		if !ok || !validDigest(sha) || c.flights[sha] != nil {
			continue
		}
		if fi, err := e.Info(); err == nil && time.Since(fi.ModTime()) > partialMaxAge {
			c.removePartial(sha)
			c.log.Info("imagecache: removed a partial download nobody resumed", "sha256", sha, "bytes", fi.Size())
		}
	}
}
