package reconcile

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// gatedImages is an Images that counts pins per digest and holds each download
// at a gate until the test opens it.
type gatedImages struct {
	mu    sync.Mutex
	held  map[string]int
	gate  chan struct{}
	fails bool
}

func (p *gatedImages) count(sha string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.held[sha]
}

func (p *gatedImages) resolve(ctx context.Context, _, sha string, progress func(done, total int64)) (string, func(), error) {
	progress(1<<20, 4<<20)
	select {
	case <-p.gate:
	case <-ctx.Done():
		return "", nil, ctx.Err()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fails {
		return "", nil, errors.New("the server answered 404 Not Found")
	}
	p.held[sha]++
	var once sync.Once
	return "/cache/" + sha + ".raw", func() {
		once.Do(func() {
			p.mu.Lock()
			p.held[sha]--
			p.mu.Unlock()
		})
	}, nil
}

func imageRow(rep *eitriv1.ActualStateReport, sha string) *eitriv1.ImageHeld {
	for _, r := range rep.GetImages() {
		if r.GetSha256() == sha {
			return r
		}
	}
	return nil
}

// An image the snapshot wants is fetched with the create's narration,
// then held pinned; a snapshot that no longer lists it unpins it.
func TestAWantedImageIsPulledNarratedAndPinnedUntilUnlisted(t *testing.T) {
	p := &gatedImages{held: map[string]int{}, gate: make(chan struct{})}
	f := setup(t, func(c *Config) { c.Images = p.resolve })
	sha := strings.Repeat("ab", 32)
	want := &eitriv1.DesiredStateSnapshot{Generation: 1, Images: []*eitriv1.ImageWanted{{Url: "http://images.test/d.raw", Sha256: sha}}}
	require.True(t, f.eng.Apply(want))

	require.Eventually(t, func() bool {
		r := imageRow(f.eng.Report(), sha)
		return r != nil && r.GetProgress().GetDoneBytes() == 1<<20
	}, 5*time.Second, time.Millisecond, "the download is measured as a create's is")
	r := imageRow(f.eng.Report(), sha)
	assert.False(t, r.GetHeld())
	assert.Equal(t, "downloading image 1.0/4.0 MiB", r.GetStatusDetail())

	close(p.gate)
	require.Eventually(t, func() bool { return imageRow(f.eng.Report(), sha).GetHeld() }, 5*time.Second, time.Millisecond)
	r = imageRow(f.eng.Report(), sha)
	assert.Empty(t, r.GetStatusDetail(), "a held image says nothing more")
	assert.Nil(t, r.GetProgress())
	assert.Equal(t, 1, p.count(sha), "pinned while wanted")

	// The same list again changes nothing: no second pull, no second pin.
	require.True(t, f.eng.Apply(&eitriv1.DesiredStateSnapshot{Generation: 2, Images: want.Images}))
	assert.Equal(t, 1, p.count(sha))

	require.True(t, f.eng.Apply(&eitriv1.DesiredStateSnapshot{Generation: 3}))
	require.Eventually(t, func() bool { return p.count(sha) == 0 }, 5*time.Second, time.Millisecond, "unpinned once no longer wanted")
	assert.Nil(t, imageRow(f.eng.Report(), sha), "and no longer reported")
}

func TestAFailedPullSaysWhy(t *testing.T) {
	p := &gatedImages{held: map[string]int{}, gate: make(chan struct{}), fails: true}
	close(p.gate)
	f := setup(t, func(c *Config) { c.Images = p.resolve })
	sha := strings.Repeat("cd", 32)
	require.True(t, f.eng.Apply(&eitriv1.DesiredStateSnapshot{Generation: 1, Images: []*eitriv1.ImageWanted{{Url: "http://images.test/x.raw", Sha256: sha}}}))
	require.Eventually(t, func() bool { return imageRow(f.eng.Report(), sha).GetError() != "" }, 5*time.Second, time.Millisecond)
	r := imageRow(f.eng.Report(), sha)
	assert.Equal(t, "the server answered 404 Not Found", r.GetError())
	assert.False(t, r.GetHeld())
	assert.Empty(t, r.GetStatusDetail())
}

// A pull of an image the cache already holds downloads nothing, and its
// row says so until the image is held.
func TestAPullOfACachedImageSaysItUsesIt(t *testing.T) {
	gate := make(chan struct{})
	f := setup(t, func(c *Config) {
		c.ImageCached = func(string) bool { return true }
		c.Images = func(ctx context.Context, _, sha string, _ func(done, total int64)) (string, func(), error) {
			select {
			case <-gate:
			case <-ctx.Done():
				return "", nil, ctx.Err()
			}
			return "/cache/" + sha + ".raw", func() {}, nil
		}
	})
	sha := strings.Repeat("cd", 32)
	require.True(t, f.eng.Apply(&eitriv1.DesiredStateSnapshot{Generation: 1, Images: []*eitriv1.ImageWanted{{Url: "http://images.test/d.raw", Sha256: sha}}}))
	require.Eventually(t, func() bool { return imageRow(f.eng.Report(), sha).GetStatusDetail() != "" }, 5*time.Second, time.Millisecond)
	r := imageRow(f.eng.Report(), sha)
	assert.Equal(t, "using the cached image", r.GetStatusDetail())
	assert.Nil(t, r.GetProgress(), "nothing to count")
	close(gate)
	require.Eventually(t, func() bool { return imageRow(f.eng.Report(), sha).GetHeld() }, 5*time.Second, time.Millisecond)
}
