package reconcile

import (
	"context"
	"regexp"
	"slices"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

var sha256Hex = regexp.MustCompile(`^[0-9a-f]{64}$`)

// pullRetry spaces a failed pull's attempts: the snapshot still wants the
// image, so the host keeps trying, without hammering a server that failed.
const pullRetry = 30 * time.Second

// pull is one image the control plane wants held ahead of creates
// (DesiredStateSnapshot.images): fetched through the same cache and
// narration as a create's download, then kept pinned (its release not yet
// called) until the snapshot no longer lists it.
type pull struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu  sync.Mutex
	row *eitriv1.ImageHeld
}

func (p *pull) set(fn func(r *eitriv1.ImageHeld)) {
	p.mu.Lock()
	next := proto.CloneOf(p.row)
	fn(next)
	p.row = next
	p.mu.Unlock()
}

// applyPullsLocked starts a pull for each newly wanted image and ends those
// no longer wanted. e.mu is held.
func (e *Engine) applyPullsLocked(wanted []*eitriv1.ImageWanted) {
	if e.pulls == nil {
		e.pulls = map[string]*pull{}
	}
	keep := map[string]bool{}
	for _, w := range wanted {
		sha := w.GetSha256()
		if !sha256Hex.MatchString(sha) {
			e.log.Warn("ignoring a wanted image with an unusable digest")
			continue
		}
		keep[sha] = true
		if e.pulls[sha] != nil {
			continue
		}
		ctx, cancel := context.WithCancel(e.ctx)
		p := &pull{cancel: cancel, done: make(chan struct{}), row: &eitriv1.ImageHeld{Sha256: sha}}
		e.pulls[sha] = p
		e.wg.Add(1)
		go func() {
			defer e.wg.Done()
			defer close(p.done)
			e.runPull(ctx, p, w.GetUrl(), sha)
		}()
	}
	for sha, p := range e.pulls {
		if !keep[sha] {
			p.cancel() // runPull releases the pin on its way out
			delete(e.pulls, sha)
		}
	}
}

// runPull fetches the image, keeps it pinned until ctx ends, and retries
// a failure after pullRetry.
func (e *Engine) runPull(ctx context.Context, p *pull, url, sha string) {
	for {
		word := e.imageWord(sha)
		p.set(func(r *eitriv1.ImageHeld) { r.StatusDetail, r.Progress = word, nil })
		e.notify()
		_, release, err := e.cfg.Images(ctx, url, sha, func(done, total int64) {
			p.set(func(r *eitriv1.ImageHeld) {
				r.StatusDetail, r.Progress = downloadDetail(done, total), downloadProgress(done, total)
			})
			e.notify()
		})
		if err == nil {
			p.set(func(r *eitriv1.ImageHeld) { r.Held, r.StatusDetail, r.Progress, r.Error = true, "", nil, "" })
			e.notify()
			e.log.Info("pulled image; pinned while the control plane wants it", "sha256", sha)
			<-ctx.Done()
			release()
			return
		}
		if ctx.Err() != nil {
			return
		}
		e.log.Warn("pulling image failed; trying again", "sha256", sha, "in", pullRetry, "err", err)
		p.set(func(r *eitriv1.ImageHeld) { r.StatusDetail, r.Progress, r.Error = "", nil, err.Error() })
		e.notify()
		select {
		case <-ctx.Done():
			return
		case <-time.After(pullRetry):
		}
	}
}

// pullRowsLocked is one row per wanted image, by digest. e.mu is held.
func (e *Engine) pullRowsLocked() []*eitriv1.ImageHeld {
	rows := make([]*eitriv1.ImageHeld, 0, len(e.pulls))
	for _, p := range e.pulls {
		p.mu.Lock()
		rows = append(rows, p.row)
		p.mu.Unlock()
	}
	slices.SortFunc(rows, func(a, b *eitriv1.ImageHeld) int { return cmpString(a.GetSha256(), b.GetSha256()) })
	return rows
}
