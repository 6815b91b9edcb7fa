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

func (jsonCodec) Marshal(v any) ([]byte, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("json codec: %T is not a proto message", v)
	}
	return marshalJSON.Marshal(m)
}

func (jsonCodec) Unmarshal(b []byte, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("json codec: %T is not a proto message", v)
	}
	if len(b) == 0 {
		return nil
	}
	return unmarshalJSON.Unmarshal(b, m)
}
