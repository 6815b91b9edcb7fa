package api_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// cacheAgent is a connected host whose image cache the test plays: it
// says what the cache holds on its Sync stream, and answers each prune
// call by removing what nothing wants, as an agent does.
type cacheAgent struct {
	*agent
	id    string
	ac    eitriv1connect.AgentServiceClient
	cache []*eitriv1.CachedImage
	calls chan *eitriv1.CallsResponse
}

func (e *env) cacheAgent(name string) *cacheAgent {
	e.t.Helper()
	id, cred := e.enroll(name)
	a := e.connectWith(id, cred, big(), &eitriv1.Hello{AgentVersion: "test", Address: "192.0.2.10", Accelerator: "tcg", InstanceId: agentInstance})
	ctx, cancel := context.WithCancel(context.Background())
	e.t.Cleanup(cancel)
	c := &cacheAgent{agent: a, id: id, ac: eitriv1connect.NewAgentServiceClient(e.http, e.url, bearer(cred)), calls: make(chan *eitriv1.CallsResponse, 4)}
	go func() {
		calls, err := c.ac.Calls(ctx, connect.NewRequest(&eitriv1.CallsRequest{InstanceId: agentInstance}))
		if err != nil {
			return
		}
		for calls.Receive() {
			c.calls <- calls.Msg()
		}
	}()
	return c
}

func (c *cacheAgent) say(t *testing.T) {
	t.Helper()
	var total uint64
	for _, im := range c.cache {
		total += im.GetSizeBytes()
	}
	require.NoError(t, c.stream.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_ImageCache{
		ImageCache: &eitriv1.ImageCacheReport{Images: c.cache, TotalBytes: total},
	}}))
}

// answerPrune takes the next call, which must be a prune, and answers it
// by removing the rows neither pinned nor made into a VM.
func (c *cacheAgent) answerPrune(t *testing.T) {
	t.Helper()
	var call *eitriv1.CallsResponse
	select {
	case call = <-c.calls:
	case <-time.After(5 * time.Second):
		t.Fatal("no call reached the host")
	}
	require.NotNil(t, call.GetPruneImages(), "a prune call")
	pruned := &eitriv1.ImagesPruned{}
	var kept []*eitriv1.CachedImage
	for _, im := range c.cache {
		if im.GetPinned() || len(im.GetVmIds()) > 0 {
			kept = append(kept, im)
			continue
		}
		pruned.Removed = append(pruned.Removed, im)
		pruned.FreedBytes += im.GetSizeBytes()
	}
	c.cache = kept
	st := c.ac.Console(context.Background())
	defer func() { _ = st.CloseRequest(); _ = st.CloseResponse() }()
	require.NoError(t, st.Send(&eitriv1.ConsoleRequest{CallId: call.GetId()}))
	require.NoError(t, st.Send(&eitriv1.ConsoleRequest{Done: true, ImagesPruned: pruned}))
	c.say(t)
	_, _ = st.Receive() // the control plane ends the stream once it has the answer
}

func TestHostImagesListsTheCacheAndPruneRemovesOnlyWhatNothingWants(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	h := e.cacheAgent("h1")
	alice := e.user("alice")
	hosts := e.hosts(e.admin)

	shaPulled, shaUnused := strings.Repeat("a", 64), strings.Repeat("b", 64)
	for name, digest := range map[string]string{"debian-12": sha, "tools": shaPulled} {
		_, err := e.images(e.admin).AddImage(ctx, connect.NewRequest(&eitriv1.AddImageRequest{Name: name, Url: "https://images.test/" + name + ".qcow2", Sha256: digest}))
		require.NoError(t, err)
	}
	_, err := e.images(e.admin).PullImage(ctx, connect.NewRequest(&eitriv1.PullImageRequest{Name: "tools", HostIds: []string{h.id}}))
	require.NoError(t, err)
	vm := e.mustCreateVM(alice, createReq("web-1"))

	// Nothing said yet: nothing known, and nothing invented.
	got, err := hosts.ListHostImages(ctx, connect.NewRequest(&eitriv1.ListHostImagesRequest{Id: h.id}))
	require.NoError(t, err)
	assert.Nil(t, got.Msg.ReportedAt)
	assert.Empty(t, got.Msg.Images)

	used := time.Now().Add(-time.Hour).Truncate(time.Second)
	h.cache = []*eitriv1.CachedImage{
		{Sha256: shaPulled, SizeBytes: 3 << 20, LastUsedUnix: used.Unix(), Pinned: true},
		{Sha256: sha, SizeBytes: 5 << 20, LastUsedUnix: used.Unix(), VmIds: []string{vm.Id}},
		{Sha256: shaUnused, SizeBytes: 7 << 20, LastUsedUnix: used.Unix()},
	}
	h.say(t)
	require.Eventually(t, func() bool {
		got, err = hosts.ListHostImages(ctx, connect.NewRequest(&eitriv1.ListHostImagesRequest{Id: h.id}))
		return err == nil && len(got.Msg.Images) == 3
	}, 5*time.Second, 5*time.Millisecond, "the host's listing lands")
	assert.NotNil(t, got.Msg.ReportedAt)
	assert.Equal(t, uint64(15<<20), got.Msg.TotalBytes)
	rows := map[string]*eitriv1.HostImage{}
	for _, r := range got.Msg.Images {
		rows[r.Sha256] = r
	}
	assert.True(t, rows[shaPulled].Pinned)
	assert.Equal(t, []string{"tools"}, rows[shaPulled].PulledFor, "pinned by the pull of the catalogue image")
	assert.True(t, used.Equal(rows[shaPulled].LastUsed.AsTime()))
	require.Len(t, rows[sha].Vms, 1)
	assert.Equal(t, "web-1", rows[sha].Vms[0].Name)
	require.Len(t, rows[sha].Catalogue, 1)
	assert.Equal(t, "debian-12", rows[sha].Catalogue[0].Name)
	assert.Equal(t, int64(1), rows[sha].Catalogue[0].Version)
	assert.True(t, rows[sha].Catalogue[0].Current)
	assert.Empty(t, rows[shaUnused].Catalogue)
	assert.Empty(t, rows[shaUnused].Vms)

	// The host answers the prune with what it removed.
	answered := make(chan struct{})
	go func() { defer close(answered); h.answerPrune(t) }()
	var pr *connect.Response[eitriv1.PruneHostImagesResponse]
	require.Eventually(t, func() bool {
		// Until its calls stream is up, the host takes no calls.
		pr, err = hosts.PruneHostImages(ctx, connect.NewRequest(&eitriv1.PruneHostImagesRequest{Id: h.id}))
		return code(err) != connect.CodeUnavailable
	}, 5*time.Second, 10*time.Millisecond)
	require.NoError(t, err)
	<-answered
	require.Len(t, pr.Msg.Removed, 1)
	assert.Equal(t, shaUnused, pr.Msg.Removed[0].Sha256)
	assert.Equal(t, uint64(7<<20), pr.Msg.FreedBytes)

	require.Eventually(t, func() bool {
		got, err = hosts.ListHostImages(ctx, connect.NewRequest(&eitriv1.ListHostImagesRequest{Id: h.id}))
		return err == nil && len(got.Msg.Images) == 2
	}, 5*time.Second, 5*time.Millisecond, "the host's new listing lands")
	for _, r := range got.Msg.Images {
		assert.NotEqual(t, shaUnused, r.Sha256)
	}
}

func TestHostImagesAreForAdminsAndNameTheBadField(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	id, cred := e.enroll("h1")
	a := e.connect(id, cred, big())
	alice := e.hosts(e.user("alice"))

	_, err := alice.ListHostImages(ctx, connect.NewRequest(&eitriv1.ListHostImagesRequest{Id: id}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))
	_, err = alice.PruneHostImages(ctx, connect.NewRequest(&eitriv1.PruneHostImagesRequest{Id: id}))
	assert.Equal(t, connect.CodePermissionDenied, code(err))

	admin := e.hosts(e.admin)
	_, err = admin.ListHostImages(ctx, connect.NewRequest(&eitriv1.ListHostImagesRequest{}))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "id: required")
	_, err = admin.PruneHostImages(ctx, connect.NewRequest(&eitriv1.PruneHostImagesRequest{Id: strings.Repeat("h", 4096)}))
	assert.Equal(t, connect.CodeInvalidArgument, code(err))
	assert.ErrorContains(t, err, "id: ")
	_, err = admin.ListHostImages(ctx, connect.NewRequest(&eitriv1.ListHostImagesRequest{Id: "h-nope"}))
	assert.Equal(t, connect.CodeNotFound, code(err))
	_, err = admin.PruneHostImages(ctx, connect.NewRequest(&eitriv1.PruneHostImagesRequest{Id: "h-nope"}))
	assert.Equal(t, connect.CodeNotFound, code(err))

	// A host that is away cannot be asked.
	require.NoError(t, a.stream.CloseRequest())
	require.Eventually(t, func() bool { return !e.host(id).Connected }, 5*time.Second, 5*time.Millisecond)
	_, err = admin.PruneHostImages(ctx, connect.NewRequest(&eitriv1.PruneHostImagesRequest{Id: id}))
	assert.Equal(t, connect.CodeFailedPrecondition, code(err))
	assert.ErrorContains(t, err, "not connected")
}
