package fleet

import (
	"context"
	"errors"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/bounds"
)

// WatchImages subscribes the caller to the catalogue (or one image, by
// name) and returns what to start from. The catalogue is everyone's to
// read, so every change goes to every watcher.
func (f *Fleet) WatchImages(ctx context.Context, name string) (*watch.Watcher[*eitriv1.Image], []*eitriv1.Image, error) {
	if _, err := principal(ctx); err != nil {
		return nil, nil, err
	}
	if name == "" {
		w := f.Images.Subscribe(nil)
		list, err := f.ListImages(ctx)
		if err != nil {
			w.Close()
			return nil, nil, err
		}
		return w, list, nil
	}
	if err := checkLen("name", name, bounds.MaxNameLen); err != nil {
		return nil, nil, err
	}
	// Subscribe first, then read, so no change in between is missed.
	w := f.Images.Subscribe(func(ev watch.Event[*eitriv1.Image]) bool { return ev.ID == name })
	img, err := f.GetImage(ctx, name)
	if err != nil {
		w.Close()
		return nil, nil, err
	}
	return w, []*eitriv1.Image{img}, nil
}

// publishImage tells the image's watchers how it stands now, or that it is
// gone. With nobody watching it reads nothing: a watcher that comes later
// subscribes before it reads, and reads what this change left.
func (f *Fleet) publishImage(ctx context.Context, name string) {
	if f.Images.Watchers() == 0 {
		return
	}
	img, err := f.st.Image(ctx, name)
	if errors.Is(err, store.ErrNotFound) {
		f.Images.Publish(watch.Event[*eitriv1.Image]{ID: name, Removed: true})
		return
	}
	if err != nil {
		f.log.Warn("publish image", "image", name, "err", err)
		return
	}
	v, err := f.imageView(ctx, img)
	if err != nil {
		f.log.Warn("publish image", "image", name, "err", err)
		return
	}
	f.Images.Publish(watch.Event[*eitriv1.Image]{ID: name, Obj: v})
}

// publishHostImages republishes the images pulled to a host whose word on
// them moved (a report, or the host going away).
func (f *Fleet) publishHostImages(ctx context.Context, hostID string) {
	if f.Images.Watchers() == 0 {
		return
	}
	names, err := f.st.ImagePullsForHost(ctx, hostID)
	if err != nil {
		f.log.Warn("publish a host's images", "host", hostID, "err", err)
		return
	}
	for _, n := range names {
		f.publishImage(ctx, n)
	}
}
