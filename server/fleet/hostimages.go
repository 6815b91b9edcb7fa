package fleet

import (
	"context"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/callrelay"
)

// What each host holds in its image cache. The host sends its listing on
// its Sync stream after every connect and whenever it changes (never with
// every report), and this replica keeps the last one for as long as the
// stream lasts. A prune is an act with an answer, not a state to converge
// to, so it travels as a call (the console relay's Calls stream) and the
// agent answers it with what it removed.

const (
	// maxCacheRows and maxCacheRowVMs bound what a host's listing may make
	// this replica keep; agents send at most 256 and 64.
	maxCacheRows   = 1024
	maxCacheRowVMs = 256
	// pruneWithin bounds the wait for the host's answer once it took the
	// call: removing files is quick, but a host's disk may be busy.
	pruneWithin = 30 * time.Second
)

// ImageCache keeps the host's listing of its image cache, clipped to the
// bounds (what is clipped is counted, as the host counts what it did not
// list).
func (s *Session) ImageCache(c *eitriv1.ImageCacheReport) {
	if n := len(c.GetImages()); n > maxCacheRows {
		c.More += uint32(n - maxCacheRows)
		c.Images = c.Images[:maxCacheRows]
	}
	for _, im := range c.GetImages() {
		if n := len(im.GetVmIds()); n > maxCacheRowVMs {
			im.MoreVms += uint32(n - maxCacheRowVMs)
			im.VmIds = im.VmIds[:maxCacheRowVMs]
		}
	}
	cleanFromHost(c) // after the cuts above, which count what they cut
	f := s.f
	now := f.now()
	f.mu.Lock()
	s.images, s.imagesAt = c, now
	f.mu.Unlock()
	if f.st.Shared() && s.claim != 0 {
		// For the other replicas' ListHostImages; rare (the host sends it
		// when its cache changes), so written at once.
		b, err := proto.Marshal(c)
		if err == nil {
			err = f.st.WriteLiveImageCache(s.ctx, s.hostID, s.claim, b, now)
		}
		if err != nil && s.ctx.Err() == nil {
			f.log.Warn("share the host's image cache listing", "host", s.hostID, "err", err)
		}
	}
}

// ListHostImages is what the host's cache holds, as the host last said,
// with what each image is to the fleet: the pulls that pin it, the VMs
// made from it and the catalogue's names for it. Admins only.
func (f *Fleet) ListHostImages(ctx context.Context, id string) (*eitriv1.ListHostImagesResponse, error) {
	if _, err := requireAdmin(ctx); err != nil {
		return nil, err
	}
	if _, err := f.hostByID(ctx, id); err != nil {
		return nil, err
	}
	f.mu.Lock()
	var c *eitriv1.ImageCacheReport
	var at time.Time
	if s := f.sessions[id]; s != nil {
		c, at = s.images, s.imagesAt
	}
	f.mu.Unlock()
	out := &eitriv1.ListHostImagesResponse{}
	if c == nil && f.st.Shared() {
		// Held by another replica, which keeps the listing in the database.
		b, when, ok, err := f.st.LiveImageCache(ctx, id)
		if err != nil {
			return nil, err
		}
		if ok {
			c = &eitriv1.ImageCacheReport{}
			if err := proto.Unmarshal(b, c); err != nil {
				return nil, errorf(Unavailable, "host %s's image cache listing, kept by another replica, does not decode: %v", id, err)
			}
			at = when
		}
	}
	if c == nil {
		return out, nil // not reported: nothing is known
	}
	rows, err := f.hostImageRows(ctx, id, c.GetImages())
	if err != nil {
		return nil, err
	}
	out.Images, out.More, out.TotalBytes, out.ReportedAt = rows, c.GetMore(), c.GetTotalBytes(), timestamppb.New(at)
	return out, nil
}

// PruneHostImages has the host remove what nothing wants from its cache,
// and says what went. Admins only; the host must be connected.
func (f *Fleet) PruneHostImages(ctx context.Context, id string) (*eitriv1.PruneHostImagesResponse, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, err
	}
	if _, err := f.hostByID(ctx, id); err != nil {
		return nil, err
	}
	if !f.reg.Connected(id) {
		return nil, errorf(Precondition, "host %s is not connected; its cache can be pruned once it is back", id)
	}
	ctx, cancel := context.WithTimeout(ctx, callrelay.AnswerWithin+pruneWithin)
	defer cancel()
	a, err := f.Relay.Call(ctx, id, p, &eitriv1.CallsResponse{Call: &eitriv1.CallsResponse_PruneImages{PruneImages: &eitriv1.PruneImagesCall{}}})
	if err != nil {
		return nil, err
	}
	defer a.End()
	for {
		select {
		case <-ctx.Done():
			return nil, errorf(Unavailable, "host %s did not say what it pruned within %s; list its images to see", id, pruneWithin)
		case fr := <-a.Frames():
			m := fr.Msg
			switch {
			case m == nil:
				return nil, errorf(Unavailable, "host %s hung up before it said what it pruned (%v); list its images to see", id, fr.Err)
			case m.GetErrorCode() != "":
				return nil, errorf(Unavailable, "host %s: %s", id, clip(printable(m.GetError()), maxAgentError))
			case m.GetDone():
				pruned := m.GetImagesPruned()
				if n := len(pruned.GetRemoved()); n > maxCacheRows {
					pruned.Removed = pruned.Removed[:maxCacheRows]
				}
				rows, err := f.hostImageRows(ctx, id, pruned.GetRemoved())
				if err != nil {
					return nil, err
				}
				return &eitriv1.PruneHostImagesResponse{Removed: rows, FreedBytes: pruned.GetFreedBytes()}, nil
			}
		}
	}
}

// hostImageRows joins the host's rows with the fleet's knowledge of them.
func (f *Fleet) hostImageRows(ctx context.Context, hostID string, cached []*eitriv1.CachedImage) ([]*eitriv1.HostImage, error) {
	if len(cached) == 0 {
		return nil, nil
	}
	imgs, err := f.st.ListImages(ctx)
	if err != nil {
		return nil, err
	}
	catalogue := map[string][]*eitriv1.CatalogueVersion{}
	for _, img := range imgs {
		for _, v := range img.Versions {
			catalogue[v.SHA256] = append(catalogue[v.SHA256], &eitriv1.CatalogueVersion{Name: img.Name, Version: v.Version, Current: v.Version == img.Current})
		}
	}
	pulledFor := map[string][]string{}
	pulls, err := f.st.ImagePullsForHost(ctx, hostID)
	if err != nil {
		return nil, err
	}
	for _, name := range pulls {
		for _, img := range imgs {
			if img.Name != name {
				continue
			}
			if v, ok := img.CurrentVersion(); ok {
				pulledFor[v.SHA256] = append(pulledFor[v.SHA256], name)
			}
		}
	}
	vms, err := f.st.ListVMsByHost(ctx, hostID)
	if err != nil {
		return nil, err
	}
	names := make(map[string]string, len(vms))
	for _, v := range vms {
		names[v.ID] = v.Name
	}
	out := make([]*eitriv1.HostImage, 0, len(cached))
	for _, c := range cached {
		row := &eitriv1.HostImage{
			Sha256: c.GetSha256(), SizeBytes: c.GetSizeBytes(), Pinned: c.GetPinned(), MoreVms: c.GetMoreVms(),
			PulledFor: pulledFor[c.GetSha256()],
		}
		if c.GetLastUsedUnix() > 0 {
			row.LastUsed = timestamppb.New(time.Unix(c.GetLastUsedUnix(), 0))
		}
		for _, id := range c.GetVmIds() {
			row.Vms = append(row.Vms, &eitriv1.HostImageVM{Id: id, Name: names[id]})
		}
		for _, cv := range catalogue[c.GetSha256()] {
			row.Catalogue = append(row.Catalogue, proto.CloneOf(cv))
		}
		out = append(out, row)
	}
	return out, nil
}
