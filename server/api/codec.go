package api

import (
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// jsonCodec is the JSON people see from curl and the console: field names
// as written in the schema (image_url, not imageUrl) and every field present,
// with null for a message nobody set — so "not reported" reads as null and
// never as a zero. Input accepts both spellings and skips unknown fields, so
// a newer client does not break an older server.
type jsonCodec struct{ name string }

var (
	marshalJSON   = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}
	unmarshalJSON = protojson.UnmarshalOptions{DiscardUnknown: true}
)

func (c jsonCodec) Name() string { return c.name }

func (c jsonCodec) Marshal(v any) ([]byte, error) { return c.MarshalAppend(nil, v) }

// MarshalAppend lets Connect encode into its pooled buffers.
func (c jsonCodec) MarshalAppend(dst []byte, v any) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return dst, errNotProto(v)
	}
	return appendShared(dst, c.name, v, func(b []byte) ([]byte, error) { return marshalJSON.MarshalAppend(b, m) })
}

func (jsonCodec) Unmarshal(b []byte, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return errNotProto(v)
	}
	if len(b) == 0 {
		return nil
	}
	return unmarshalJSON.Unmarshal(b, m)
}

func errNotProto(v any) error { return fmt.Errorf("codec: %T is not a proto message", v) }
