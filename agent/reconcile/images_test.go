package reconcile

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// pins is an Images that counts the pins it hands out and gets back.
type pins struct {
	mu       sync.Mutex
	held     int
	resolved int
	// path is what a resolve returns; wait, when set, runs first (a fetch
	// that finishes only as the pass's time runs out).
	path string
	wait func(ctx context.Context)
}

func (p *pins) resolve(ctx context.Context, _, _ string, _ func(done, total int64)) (string, func(), error) {
	if p.wait != nil {
		p.wait(ctx)
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.held++
	p.resolved++
	var once sync.Once
	return p.path, func() {
		once.Do(func() {
			p.mu.Lock()
			defer p.mu.Unlock()
			p.held--
		})
	}, nil
}

func (p *pins) counts() (held, resolved int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held, p.resolved
}

func TestAResolvedImageIsReleasedOnEveryPath(t *testing.T) {
	for _, c := range []struct {
		name        string
		images      *pins
		timeout     time.Duration
		wantPrepare int
		wantPhase   string
	}{
		{name: "root disk made", images: &pins{path: "/cache/x.raw"}, wantPrepare: 1, wantPhase: "ready"},
		// The fake hypervisor refuses an empty base.
		{name: "root disk failed", images: &pins{path: ""}, wantPrepare: 1, wantPhase: "creating"},
		{name: "time ran out between the download and the root disk", timeout: 20 * time.Millisecond, wantPrepare: 0, wantPhase: "creating",
			images: &pins{path: "/cache/x.raw", wait: func(ctx context.Context) { <-ctx.Done() }}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := setup(t, func(cfg *Config) {
				cfg.Images = c.images.resolve
				cfg.VMTimeout = c.timeout
			})
			rep := f.apply(snap(1, vm("vm1")))
			assert.Equal(t, c.wantPhase, findVM(rep, "vm1").GetPhase())
			held, resolved := c.images.counts()
			assert.Equal(t, 1, resolved)
			assert.Zero(t, held, "the image is released, so the cache may evict it")
			assert.Equal(t, c.wantPrepare, f.hv.count("prepare"))
		})
	}
}
