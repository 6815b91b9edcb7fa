package api

import (
	"runtime"
	"testing"
	"time"
	"weak"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestASharedWatchEventIsEncodedOncePerCodec(t *testing.T) {
	msg := &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_Changed{Changed: &eitriv1.VM{Id: "vm-1", StatusDetail: "booting"}}}
	share(msg, &encodings{})

	first, err := protoCodec{}.MarshalAppend(nil, msg)
	require.NoError(t, err)
	want, _ := proto.Marshal(msg)
	assert.Equal(t, want, first)

	// Change the message behind the cache's back: a cached encoding is what
	// every later watcher gets, so the bytes must not move.
	msg.GetChanged().StatusDetail = "ready"
	again, err := protoCodec{}.MarshalAppend([]byte("prefix"), msg)
	require.NoError(t, err)
	assert.Equal(t, append([]byte("prefix"), want...), again, "encoded once, then copied out")

	// Scribbling on what a caller got back cannot reach the cache (Connect
	// recycles its buffers).
	for i := range first {
		first[i] = 0
	}
	third, _ := protoCodec{}.Marshal(msg)
	assert.Equal(t, want, third)

	// JSON is encoded on its own first use.
	j, err := jsonCodec{name: "json"}.Marshal(msg)
	require.NoError(t, err)
	assert.Contains(t, string(j), `"status_detail":"ready"`, "first JSON encoding happens now, after the change")
}

// The table never keeps a message alive: its entry goes with the message.
func TestASharedMessagesEntryGoesWithTheMessage(t *testing.T) {
	msg := &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_RemovedId{RemovedId: "gone"}}
	enc := &encodings{}
	share(msg, enc)
	key := weak.Make(msg)
	_, ok := sharedWire.Load(key)
	require.True(t, ok)
	msg = nil
	assert.Eventually(t, func() bool {
		runtime.GC()
		_, ok := sharedWire.Load(key)
		return !ok
	}, 5*time.Second, 10*time.Millisecond, "the entry is dropped once its message is collected")
	runtime.KeepAlive(enc)
}

func TestAnUnsharedMessageIsEncodedEveryTime(t *testing.T) {
	msg := &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_RemovedId{RemovedId: "a"}}
	b1, _ := protoCodec{}.Marshal(msg)
	msg.Event = &eitriv1.WatchVMsResponse_RemovedId{RemovedId: "b"}
	b2, _ := protoCodec{}.Marshal(msg)
	assert.NotEqual(t, b1, b2)
}

// BenchmarkFanOut100Watchers is one change sent to 100 watchers: encoded
// once and copied (shared) against encoded for each watcher (unshared).
func BenchmarkFanOut100Watchers(b *testing.B) {
	vm := &eitriv1.VM{Id: "vm-1", Name: "web-1", HostId: "h-1", ImageUrl: "https://images.example/debian.qcow2",
		ImageSha256: "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef", Vcpus: 2, MemMb: 2048, DiskGb: 20,
		PowerState: "running", Status: "creating", Lifecycle: "creating", StatusDetail: "downloading image 1.2/3.7 GiB"}
	for _, tc := range []struct {
		name  string
		share bool
	}{{"shared", true}, {"unshared", false}} {
		b.Run(tc.name, func(b *testing.B) {
			buf := make([]byte, 0, 1024)
			for range b.N {
				msg := &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_Changed{Changed: vm}}
				if tc.share {
					share(msg, &encodings{})
				}
				for range 100 {
					var err error
					if buf, err = (jsonCodec{name: "json"}).MarshalAppend(buf[:0], msg); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
