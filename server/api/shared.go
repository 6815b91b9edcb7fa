package api

import (
	"runtime"
	"sync"
	"weak"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// sharedWire finds a watch change's encodings from its message, for the
// streams that send it through Connect (whose codec sees only the message),
// so a change is serialized once per codec rather than once per watcher.
// Keys are weak pointers: an entry never keeps its message alive, and a
// cleanup drops it once the message is gone (a new message at the same
// address gets a different weak pointer, so it can never read stale bytes).
var sharedWire sync.Map // weak.Pointer[R] → *encodings

// encodings are one message's bytes per codec, each made on first use and
// never changed after: they are only ever copied out (Connect recycles the
// buffers a codec hands it).
type encodings struct {
	protoOnce sync.Once
	proto     []byte
	protoErr  error
	jsonOnce  sync.Once
	json      []byte
	jsonErr   error
}

// of returns m's encoding for codec ("proto", or a JSON codec's name).
func (e *encodings) of(m proto.Message, codec string) ([]byte, error) {
	if codec == "proto" {
		e.protoOnce.Do(func() { e.proto, e.protoErr = proto.MarshalOptions{}.Marshal(m) })
		return e.proto, e.protoErr
	}
	e.jsonOnce.Do(func() { e.json, e.jsonErr = marshalJSON.Marshal(m) })
	return e.json, e.jsonErr
}

// share lets Connect's codecs find msg's encodings: msg is sent, unchanged,
// to many streams.
func share[R any](msg *R, enc *encodings) {
	key := weak.Make(msg)
	if _, ok := sharedWire.Load(key); ok {
		return // every stream after the first
	}
	if _, loaded := sharedWire.LoadOrStore(key, enc); !loaded {
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

// appendShared appends m's encoding for codec to dst: a shared message's
// bytes, made at most once per codec, or encode's for any other.
func appendShared(dst []byte, codec string, m proto.Message, encode func([]byte) ([]byte, error)) ([]byte, error) {
	key, ok := sharedKey(m)
	if !ok {
		return encode(dst)
	}
	e, ok := sharedWire.Load(key)
	if !ok {
		return encode(dst)
	}
	b, err := e.(*encodings).of(m, codec)
	if err != nil {
		return dst, err
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
	return appendShared(dst, "proto", m, func(b []byte) ([]byte, error) { return proto.MarshalOptions{}.MarshalAppend(b, m) })
}

func (protoCodec) Unmarshal(b []byte, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return errNotProto(v)
	}
	return proto.Unmarshal(b, m)
}
