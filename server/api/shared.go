package api

import (
	"runtime"
	"sync"
	"weak"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// sharedWire remembers the encodings of watch events every watcher sends,
// so a change is serialized once per codec rather than once per watcher.
// Keys are weak pointers: an entry never keeps its message alive, and a
// cleanup drops it once the message is gone (a new message at the same
// address gets a different weak pointer, so it can never read stale bytes).
var sharedWire sync.Map // weak.Pointer[R] → *encodings

type encodings struct {
	mu sync.Mutex
	by map[string][]byte // codec name → bytes
}

// share marks msg as sent, unchanged, to many streams.
func share[R any](msg *R) {
	key := weak.Make(msg)
	if _, ok := sharedWire.Load(key); ok {
		return // every stream after the first
	}
	if _, loaded := sharedWire.LoadOrStore(key, &encodings{by: map[string][]byte{}}); !loaded {
		runtime.AddCleanup(msg, func(k weak.Pointer[R]) { sharedWire.Delete(k) }, key)
	}
}

// sharedKey is the cache key for a message the watch streams send; only
// those are ever shared.
func sharedKey(v any) (any, bool) {
	switch m := v.(type) {
	case *eitriv1.WatchVMsResponse:
		return weak.Make(m), true
	case *eitriv1.WatchExposuresResponse:
		return weak.Make(m), true
	case *eitriv1.WatchHostsResponse:
		return weak.Make(m), true
	}
	return nil, false
}

// appendShared appends v's encoding for codec name to dst, encoding a
// shared message at most once per codec. The cached bytes are only ever
// copied out: Connect recycles the buffers a codec hands it.
func appendShared(dst []byte, name string, v any, encode func([]byte) ([]byte, error)) ([]byte, error) {
	key, ok := sharedKey(v)
	if !ok {
		return encode(dst)
	}
	e, ok := sharedWire.Load(key)
	if !ok {
		return encode(dst)
	}
	enc := e.(*encodings)
	enc.mu.Lock()
	defer enc.mu.Unlock()
	b, ok := enc.by[name]
	if !ok {
		var err error
		if b, err = encode(nil); err != nil {
			return dst, err
		}
		enc.by[name] = b
	}
	return append(dst, b...), nil
}

// protoCodec is Connect's binary codec with the shared-encoding cache.
type protoCodec struct{}

func (protoCodec) Name() string { return "proto" }

func (c protoCodec) Marshal(v any) ([]byte, error) { return c.MarshalAppend(nil, v) }

// MarshalAppend lets Connect encode into its pooled buffers.
func (protoCodec) MarshalAppend(dst []byte, v any) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return dst, errNotProto(v)
	}
	return appendShared(dst, "proto", v, func(b []byte) ([]byte, error) { return proto.MarshalOptions{}.MarshalAppend(b, m) })
}

func (protoCodec) Unmarshal(b []byte, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return errNotProto(v)
	}
	return proto.Unmarshal(b, m)
}
