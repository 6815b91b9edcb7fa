package fleet

import (
	"context"
	"encoding/base64"
	"fmt"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
)

// Pages of a VM's timeline.
const (
	// DefaultVMEventsPage is the page size of a request that names none.
	DefaultVMEventsPage = 100
	// MaxVMEventsPage is the largest page; a request for more gets this.
	// It is all a VM keeps, so one largest page is the whole timeline.
	MaxVMEventsPage = store.MaxVMEvents
)

// ListVMEvents returns a page of a VM's timeline: the newest events before
// the request's page token (the newest of all without one), oldest first,
// and the token for the page before it ("" when there is none).
func (f *Fleet) ListVMEvents(ctx context.Context, r *eitriv1.ListVMEventsRequest) (*eitriv1.ListVMEventsResponse, error) {
	id := r.GetVmId()
	if _, _, err := f.visible(ctx, id); err != nil {
		return nil, err
	}
	size := int(r.GetPageSize())
	switch {
	case size < 0:
		return nil, invalid("page_size", "must not be negative (0 is %d, at most %d), got %d", DefaultVMEventsPage, MaxVMEventsPage, size)
	case size == 0:
		size = DefaultVMEventsPage
	case size > MaxVMEventsPage:
		size = MaxVMEventsPage
	}
	var before *store.VMEventCursor
	if tok := r.GetPageToken(); tok != "" {
		c, err := parseEventsToken(tok)
		if err != nil {
			return nil, err
		}
		before = &c
	}
	// One more than the page says whether an older page exists.
	evs, err := f.st.ListVMEventsBefore(ctx, id, before, size+1)
	if err != nil {
		return nil, err
	}
	out := &eitriv1.ListVMEventsResponse{}
	if len(evs) > size {
		evs = evs[1:]
		out.NextPageToken = eventsToken(store.VMEventCursor{At: evs[0].At, ID: evs[0].ID})
	}
	out.Events = make([]*eitriv1.VMEvent, len(evs))
	for i, e := range evs {
		out.Events[i] = &eitriv1.VMEvent{At: timestamppb.New(e.At), Kind: e.Kind, Message: e.Message}
	}
	return out, nil
}

// eventsToken is the page token naming the event a page starts at. It is
// opaque to clients; it names a place, not a row, so it still reads on
// once that event has been dropped.
func eventsToken(c store.VMEventCursor) string {
	return base64.RawURLEncoding.EncodeToString(fmt.Appendf(nil, "e1.%d.%d", c.At.UnixNano(), c.ID))
}

func parseEventsToken(tok string) (store.VMEventCursor, error) {
	bad := invalid("page_token", "is not a next_page_token of ListVMEvents")
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return store.VMEventCursor{}, bad
	}
	ver, rest, _ := strings.Cut(string(raw), ".")
	at, id, ok := strings.Cut(rest, ".")
	if ver != "e1" || !ok {
		return store.VMEventCursor{}, bad
	}
	ns, err1 := strconv.ParseInt(at, 10, 64)
	n, err2 := strconv.ParseInt(id, 10, 64)
	if err1 != nil || err2 != nil || n <= 0 {
		return store.VMEventCursor{}, bad
	}
	return store.VMEventCursor{At: time.Unix(0, ns).UTC(), ID: n}, nil
}
