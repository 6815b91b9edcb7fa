package agent

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"time"

	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

const (
	// maxReportedImages bounds the rows of one cache report; the rest are
	// counted. A cache holds a handful of images; a few hundred is already
	// a misuse worth seeing, not worth a megabyte a report.
	maxReportedImages = 256
	// maxReportedVMs bounds the VMs named on one row.
	maxReportedVMs = 64
)

// CacheReport is the host's image cache as the control plane sees it: its
// listing with the VMs made from each image (Report, sent when Changed
// fires), and the prune the control plane can ask for (Prune).
type CacheReport struct {
	Cache *imagecache.Cache
	// State holds the VM records: what each VM was made from.
	State *state.Store
	Log   *slog.Logger
}

// madeFrom maps each digest to the VMs this host holds records of that
// were made from it, ids sorted. A record that cannot be read is an error:
// it may be a VM whose base must stay.
func (r CacheReport) madeFrom() (map[string][]string, error) {
	ids, err := r.State.ListVMs()
	if err != nil {
		return nil, err
	}
	slices.Sort(ids)
	out := map[string][]string{}
	for _, id := range ids {
		rec, ok, err := r.State.LoadVM(id)
		if err != nil {
			return nil, fmt.Errorf("vm %s: %w", id, err)
		}
		if ok && rec.Spec.ImageSHA256 != "" {
			out[rec.Spec.ImageSHA256] = append(out[rec.Spec.ImageSHA256], id)
		}
	}
	return out, nil
}

func cachedRow(im imagecache.Image, vms []string) *eitriv1.CachedImage {
	row := &eitriv1.CachedImage{Sha256: im.SHA256, SizeBytes: uint64(max(im.Bytes, 0)), LastUsedUnix: im.LastUsed.Unix(), Pinned: im.Pinned}
	if len(vms) > maxReportedVMs {
		row.MoreVms = uint32(len(vms) - maxReportedVMs)
		vms = vms[:maxReportedVMs]
	}
	row.VmIds = vms
	return row
}

// Report lists the cache, most recently used first, within the bounds.
func (r CacheReport) Report() *eitriv1.ImageCacheReport {
	rep := &eitriv1.ImageCacheReport{}
	ims, err := r.Cache.Images()
	if err != nil {
		r.Log.Warn("cannot list the image cache for the control plane", "err", err)
	}
	uses, err := r.madeFrom()
	if err != nil {
		// The listing still says what is cached; only its VMs go unnamed.
		r.Log.Warn("cannot tell which VMs use the cached images", "err", err)
	}
	for i, im := range ims {
		rep.TotalBytes += uint64(max(im.Bytes, 0))
		if i >= maxReportedImages {
			rep.More++
			continue
		}
		rep.Images = append(rep.Images, cachedRow(im, uses[im.SHA256]))
	}
	return rep
}

// Prune removes what nothing wants: the cache keeps what is pinned (pulls,
// creates in progress), and every image a VM on this host was made from
// stays too, whether its root disk holds a hard link to it or reads the
// cache's file itself.
func (r CacheReport) Prune(ctx context.Context) (*eitriv1.ImagesPruned, error) {
	uses, err := r.madeFrom()
	if err != nil {
		return nil, fmt.Errorf("prune refused: cannot tell which images the VMs on this host need: %w", err)
	}
	removed, err := r.Cache.Prune(ctx, func(sha string) bool { return len(uses[sha]) > 0 })
	out := &eitriv1.ImagesPruned{}
	for _, im := range removed {
		out.Removed = append(out.Removed, cachedRow(im, nil))
		out.FreedBytes += uint64(max(im.Bytes, 0))
	}
	if err != nil {
		return nil, err
	}
	r.Log.Info("pruned the image cache", "images", len(out.Removed), "freed_bytes", out.FreedBytes)
	return out, nil
}

// vmsCheckEvery is how often the VM records are looked at for a VM made or
// destroyed, which changes the listing without touching the cache.
const vmsCheckEvery = 5 * time.Second

// Changed fires (coalesced) when Report may say something new: the cache
// changed, or the set of VM records did. It runs until ctx ends.
func (r CacheReport) Changed(ctx context.Context) <-chan struct{} {
	out := make(chan struct{}, 1)
	signal := func() {
		select {
		case out <- struct{}{}:
		default:
		}
	}
	go func() {
		t := time.NewTicker(vmsCheckEvery)
		defer t.Stop()
		last, _ := r.State.ListVMs()
		slices.Sort(last)
		for {
			select {
			case <-ctx.Done():
				return
			case <-r.Cache.Changed():
				signal()
			case <-t.C:
				ids, err := r.State.ListVMs()
				if err != nil {
					continue
				}
				slices.Sort(ids)
				if !slices.Equal(ids, last) {
					last = ids
					signal()
				}
			}
		}
	}()
	return out
}
