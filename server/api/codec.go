package api

import (
	"bytes"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"unicode"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
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
	return appendShared(dst, c.name, m, func(b []byte) ([]byte, error) { return marshalJSON.MarshalAppend(b, m) })
}

func (jsonCodec) Unmarshal(b []byte, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return errNotProto(v)
	}
	if len(b) == 0 {
		return nil
	}
	if err := unmarshalJSON.Unmarshal(b, m); err != nil {
		return decodeError(err, b, m.ProtoReflect().Descriptor())
	}
	return nil
}

func errNotProto(v any) error { return fmt.Errorf("codec: %T is not a proto message", v) }

// protojsonErr picks the position and the rest out of protojson's error
// text ("proto: (line 1:11): invalid value for int64 field memMb: …"; the
// space after "proto:" is a no-break space in some builds, on purpose, so
// nobody matches the text exactly — this only rewords it and falls back to
// it unchanged).
var (
	protojsonErr = regexp.MustCompile(`^proto:[\s\p{Zs}]*(?:syntax error[\s\p{Zs}]*)?(?:\((line \d+:\d+)\):[\s\p{Zs}]*)?(.*)$`)
	jsonFieldRef = regexp.MustCompile(`field "?([A-Za-z_][A-Za-z0-9_]*)"?`)
)

// decodeError rewords a protojson error in the API's words: the field by
// its schema name (mem_mb, as every response and validation error spells
// it, not protojson's memMb), first, like the validation errors do.
func decodeError(err error, in []byte, desc protoreflect.MessageDescriptor) error {
	m := protojsonErr.FindStringSubmatch(err.Error())
	if m == nil {
		return err
	}
	pos, msg := m[1], m[2]
	if pos != "" {
		pos = " (" + pos + ")"
	}
	if ref := jsonFieldRef.FindStringSubmatchIndex(msg); ref != nil {
		jsonName := msg[ref[2]:ref[3]]
		if name, ok := protoName(desc, jsonName, map[protoreflect.FullName]bool{}); ok {
			msg = msg[:ref[0]] + "field" + msg[ref[1]:]
			return fmt.Errorf("%s: %s%s", name, msg, pos)
		}
	}
	// Some errors (a bad Duration, say) name no field: the key before the
	// position they point at is the one.
	if key, ok := keyBefore(in, m[1]); ok {
		if name, ok := protoName(desc, key, map[protoreflect.FullName]bool{}); ok {
			return fmt.Errorf("%s: %s%s", name, msg, pos)
		}
	}
	return fmt.Errorf("invalid JSON%s: %s", pos, msg)
}

var linePos = regexp.MustCompile(`^line (\d+):(\d+)$`)

// keyBefore returns the object key whose value starts at pos ("line L:C",
// C counted in characters from 1) in the JSON text in.
func keyBefore(in []byte, pos string) (string, bool) {
	m := linePos.FindStringSubmatch(pos)
	if m == nil {
		return "", false
	}
	line, _ := strconv.Atoi(m[1])
	col, _ := strconv.Atoi(m[2])
	lines := bytes.SplitAfter(in, []byte("\n"))
	if line < 1 || line > len(lines) {
		return "", false
	}
	before := []rune(string(bytes.Join(lines[:line-1], nil)))
	cur := []rune(string(lines[line-1]))
	if col < 1 || col-1 > len(cur) {
		return "", false
	}
	text := strings.TrimRightFunc(string(append(before, cur[:col-1]...)), unicode.IsSpace)
	text, ok := strings.CutSuffix(text, ":")
	if !ok {
		return "", false
	}
	text, ok = strings.CutSuffix(strings.TrimRightFunc(text, unicode.IsSpace), `"`)
	if !ok {
		return "", false
	}
	start := strings.LastIndexByte(text, '"')
	if start < 0 {
		return "", false
	}
	return text[start+1:], true
}

// protoName finds the schema name of the field spelled jsonName in desc or
// a message it holds.
func protoName(desc protoreflect.MessageDescriptor, jsonName string, seen map[protoreflect.FullName]bool) (string, bool) {
	if seen[desc.FullName()] {
		return "", false
	}
	seen[desc.FullName()] = true
	fields := desc.Fields()
	for i := range fields.Len() {
		if f := fields.Get(i); f.JSONName() == jsonName || string(f.Name()) == jsonName {
			return string(f.Name()), true
		}
	}
	for i := range fields.Len() {
		if sub := fields.Get(i).Message(); sub != nil {
			if name, ok := protoName(sub, jsonName, seen); ok {
				return name, true
			}
		}
	}
	return "", false
}
