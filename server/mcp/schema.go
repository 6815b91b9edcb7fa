package mcp

import (
	"fmt"

	"github.com/google/jsonschema-go/jsonschema"

	"github.com/a73x/eitri/wire/bounds"
)

// Id examples, shaped as the fleet mints them (prefix, '-', 16 base32).
const (
	exampleVMID       = "vm-k3j5x7q2m4n6p2r5"
	exampleExposureID = "x-h2d4f6g3j7k3l5m7"
)

// schemaFor infers T's schema (field names, types, descriptions, which
// fields are required) and lets fix add what Go types cannot say. A type
// the inference refuses is a programming error every test finds.
func schemaFor[T any](fix func(props map[string]*jsonschema.Schema)) *jsonschema.Schema {
	s, err := jsonschema.For[T](nil)
	if err != nil {
		panic(fmt.Sprintf("mcp: input schema: %v", err))
	}
	if fix != nil {
		fix(s.Properties)
	}
	return s
}

// The helpers below publish the fleet's bounds (wire/bounds) in the input
// schemas, so a model sees them before it calls. The fleet still checks
// every call: a schema is advice to the client and a first gate here, never
// the only one.

// between bounds an integer property.
func between(s *jsonschema.Schema, lo, hi float64) {
	s.Minimum, s.Maximum = &lo, &hi
}

// atLeast bounds an integer property from below only.
func atLeast(s *jsonschema.Schema, lo float64) {
	s.Minimum, s.Maximum = &lo, nil
}

// length bounds a string property; the fleet counts bytes, the schema
// runes, so the schema is never the stricter of the two.
func length(s *jsonschema.Schema, lo, hi int) {
	if lo > 0 {
		s.MinLength = &lo
	}
	s.MaxLength = &hi
}

// oneOf lists the words a string property takes.
func oneOf(s *jsonschema.Schema, words ...string) {
	s.Enum = make([]any, len(words))
	for i, w := range words {
		s.Enum[i] = w
	}
}

// idProp is a required id: never empty, never longer than an id can be.
func idProp(s *jsonschema.Schema, example string) {
	length(s, 1, bounds.MaxIDLen)
	s.Examples = []any{example}
}
