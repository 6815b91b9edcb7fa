package mcp

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"
)

// argChecks holds each tool's input schema, to check a call's arguments
// against before the SDK does. The SDK's own check refuses the same
// arguments, in a validator's words ("validating /properties/vcpus:
// minimum: 0/1 is less than 1.000000"); this one answers as the API does
// ("invalid_argument: vcpus: must be between 1 and 256, got 0"), so a bad
// argument reads the same whichever client sent it. The schemas are flat
// objects of integers and strings, which is all this needs to understand.
type argChecks map[string]*jsonschema.Schema

// middleware refuses a tools/call whose arguments its tool's schema
// refuses, as a tool error, before the tool (or the SDK's check) runs.
func (c argChecks) middleware(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		if method != "tools/call" {
			return next(ctx, method, req)
		}
		p, ok := req.GetParams().(*mcp.CallToolParamsRaw)
		if !ok {
			return next(ctx, method, req)
		}
		s, ok := c[p.Name]
		if !ok {
			return next(ctx, method, req)
		}
		if field, msg := checkArgs(p.Name, s, p.Arguments); field != "" {
			res := &mcp.CallToolResult{}
			res.SetError(fmt.Errorf("%s: %s: %s", connect.CodeInvalidArgument, field, msg))
			return res, nil
		}
		return next(ctx, method, req)
	}
}

// checkArgs returns the first field at fault and what is wrong with it, in
// a stable order (unknown fields, then missing, then values in the
// schema's order); "" when all is well.
func checkArgs(tool string, s *jsonschema.Schema, raw json.RawMessage) (field, msg string) {
	args := map[string]json.RawMessage{}
	if len(bytes.TrimSpace(raw)) > 0 && string(bytes.TrimSpace(raw)) != "null" {
		if err := json.Unmarshal(raw, &args); err != nil {
			return "arguments", "must be a JSON object"
		}
	}
	order := s.PropertyOrder
	if len(order) == 0 {
		for k := range s.Properties {
			order = append(order, k)
		}
		slices.Sort(order)
	}
	unknown := make([]string, 0, len(args))
	for k := range args {
		if _, ok := s.Properties[k]; !ok {
			unknown = append(unknown, k)
		}
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		takes := "no arguments"
		if len(order) > 0 {
			takes = strings.Join(order, ", ")
		}
		return unknown[0], fmt.Sprintf("unknown field (%s takes %s)", tool, takes)
	}
	for _, k := range s.Required {
		if _, ok := args[k]; !ok {
			return k, "required"
		}
	}
	for _, k := range order {
		if v, ok := args[k]; ok {
			if msg := checkValue(s.Properties[k], v); msg != "" {
				return k, msg
			}
		}
	}
	return "", ""
}

// checkValue words what is wrong with one value, in the fleet's phrasing
// where the fleet has one.
func checkValue(s *jsonschema.Schema, raw json.RawMessage) string {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return "not valid JSON"
	}
	switch s.Type {
	case "integer":
		n, ok := v.(json.Number)
		if !ok {
			return "must be an integer, got " + jsonKind(v)
		}
		f, err := n.Float64()
		if err != nil || f != math.Trunc(f) {
			return "must be an integer, got " + n.String()
		}
		return checkBounds(s, f)
	case "string":
		str, ok := v.(string)
		if !ok {
			return "must be a string, got " + jsonKind(v)
		}
		switch {
		case s.MinLength != nil && *s.MinLength > 0 && str == "":
			return "required"
		case s.MaxLength != nil && len(str) > *s.MaxLength:
			// Bytes, as the fleet counts: the limit protects what is stored.
			return fmt.Sprintf("at most %d bytes, got %d", *s.MaxLength, len(str))
		case s.MinLength != nil && len([]rune(str)) < *s.MinLength:
			return fmt.Sprintf("at least %d characters, got %d", *s.MinLength, len([]rune(str)))
		}
		if len(s.Enum) > 0 && !slices.Contains(s.Enum, any(str)) {
			return fmt.Sprintf("must be %s, got %q", oneOfWords(s.Enum), str)
		}
	}
	return ""
}

func checkBounds(s *jsonschema.Schema, f float64) string {
	num := fnum(f)
	switch lo, hi := s.Minimum, s.Maximum; {
	case lo != nil && hi != nil && (f < *lo || f > *hi):
		return fmt.Sprintf("must be between %s and %s, got %s", fnum(*lo), fnum(*hi), num)
	case lo != nil && f < *lo:
		return fmt.Sprintf("must be at least %s, got %s", fnum(*lo), num)
	case hi != nil && f > *hi:
		return fmt.Sprintf("must be at most %s, got %s", fnum(*hi), num)
	}
	return ""
}

func fnum(f float64) string { return strconv.FormatFloat(f, 'f', -1, 64) }

// oneOfWords lists choices as the fleet does: "tcp" or "udp".
func oneOfWords(choices []any) string {
	q := make([]string, len(choices))
	for i, c := range choices {
		q[i] = strconv.Quote(fmt.Sprint(c))
	}
	if len(q) == 1 {
		return q[0]
	}
	return strings.Join(q[:len(q)-1], ", ") + " or " + q[len(q)-1]
}

func jsonKind(v any) string {
	switch v.(type) {
	case nil:
		return "null"
	case bool:
		return "a boolean"
	case string:
		return "a string"
	case json.Number:
		return "a number"
	case []any:
		return "an array"
	default:
		return "an object"
	}
}
