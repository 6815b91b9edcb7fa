package api

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestASharedWatchEventIsEncodedOncePerCodec(t *testing.T) {
	msg := &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_Changed{Changed: &eitriv1.VM{Id: "vm-1", StatusDetail: "booting"}}}
	share(msg)

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

	// JSON is cached separately, per codec name.
	j, err := jsonCodec{name: "json"}.Marshal(msg)
	require.NoError(t, err)
	assert.Contains(t, string(j), `"status_detail":"ready"`, "first JSON encoding happens now, after the change")
}

func TestAnUnsharedMessageIsEncodedEveryTime(t *testing.T) {
	msg := &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_RemovedId{RemovedId: "a"}}
	b1, _ := protoCodec{}.Marshal(msg)
	msg.Event = &eitriv1.WatchVMsResponse_RemovedId{RemovedId: "b"}
	b2, _ := protoCodec{}.Marshal(msg)
	assert.NotEqual(t, b1, b2)
}
