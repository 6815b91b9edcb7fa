package hostvm

import (
	"context"
	"errors"
	"sync"

	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/permanent"
	"github.com/a73x/eitri/agent/reconcile"
	"github.com/a73x/eitri/agent/seed"
)

// Images adapts an image cache to the engine (Resolve is a reconcile.Images):
// each resolved image stays pinned in the cache until its release is called.
//
// Pin lifetime: Resolve pins the digest before Ensure, so no eviction can
// slip in between the download and its use; the engine releases it once
// PrepareRootDisk has returned (or the create failed before it). The qcow2
// overlay keeps its base alive through a hard link
// (qemu.Backend.PrepareRootDisk), so the cache may evict its own copy
// afterwards without harming the VM. Pins live in memory; after a restart
// only the hard links protect bases, which is all a finished disk needs.
type Images struct {
	cache *imagecache.Cache

	mu   sync.Mutex
	held map[string]int // pins taken and not yet released, per digest
}

// NewImages wraps c.
func NewImages(c *imagecache.Cache) *Images {
	return &Images{cache: c, held: map[string]int{}}
}

var _ reconcile.Images = (*Images)(nil).Resolve

// Resolve returns the local raw image for (url, sha256), downloading it if
// needed, pinned until release is called (more calls do nothing). On error
// nothing stays pinned.
func (im *Images) Resolve(ctx context.Context, url, sha256 string, progress func(done, total int64)) (string, func(), error) {
	im.pin(sha256)
	path, err := im.cache.Ensure(ctx, url, sha256, progress)
	if err != nil {
		im.unpin(sha256)
		return "", nil, err
	}
	var once sync.Once
	return path, func() { once.Do(func() { im.unpin(sha256) }) }, nil
}

// keep pins sha256 for as long as this agent runs: a root disk that reads
// the cache's file itself (no hard link) needs it there.
func (im *Images) keep(sha256 string) { im.pin(sha256) }

func (im *Images) pin(sha256 string) {
	im.mu.Lock()
	defer im.mu.Unlock()
	im.cache.Acquire(sha256)
	im.held[sha256]++
}

func (im *Images) unpin(sha256 string) {
	im.mu.Lock()
	defer im.mu.Unlock()
	if im.held[sha256]--; im.held[sha256] == 0 {
		delete(im.held, sha256)
	}
	im.cache.Release(sha256)
}

// Pinned is how many pins are held for sha256 (for tests and debugging).
func (im *Images) Pinned(sha256 string) int {
	im.mu.Lock()
	defer im.mu.Unlock()
	return im.held[sha256]
}

var _ reconcile.Seeder = (*Hypervisor)(nil).WriteSeed

// WriteSeed is the engine's Seeder: it writes the NoCloud seed with
// seed.Write, with the VM's phone-home and host certificate URLs on this
// host's guest network (the engine's instance id is the VM id). Parameters
// the seed refuses (a bad hostname or key) are a permanent error: retrying
// the same spec can never succeed.
func (h *Hypervisor) WriteSeed(outPath string, p reconcile.SeedParams) error {
	err := seed.Write(outPath, seed.Params{
		InstanceID:        p.InstanceID,
		Hostname:          p.Hostname,
		SSHAuthorizedKey:  p.SSHAuthorizedKey,
		HostPrivKey:       p.HostPrivKey,
		HostPubKey:        p.HostPubKey,
		LoginUser:         p.LoginUser,
		PhoneHomeURL:      h.net.PhoneHomeURL(p.InstanceID),
		TrustedUserCAKeys: p.TrustedUserCAKeys,
		UserCertPrincipal: p.UserCertPrincipal,
		HostCertificate:   p.HostCertificate,
		HostCertURL:       h.net.HostCertURL(p.InstanceID),
	})
	if errors.Is(err, seed.ErrInvalidParams) {
		return permanent.Wrap(err)
	}
	return err
}
