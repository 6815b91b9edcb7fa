package mcp

import (
	"context"
	"errors"
	"log/slog"

	"connectrpc.com/connect"
	"github.com/google/jsonschema-go/jsonschema"
	"github.com/modelcontextprotocol/go-sdk/mcp"

	"github.com/a73x/eitri/server/fleet"
)

type tools struct {
	f      *fleet.Fleet
	log    *slog.Logger
	checks argChecks
}

func (t *tools) register(s *mcp.Server) {
	t.registerVMs(s)
	t.registerCreate(s)
	t.registerImages(s)
	t.registerExposures(s)
	t.registerUsage(s)
}

// addTool registers a tool whose handler runs as the caller (authed), and
// keeps its input schema for the argument check.
func addTool[In, Out any](t *tools, s *mcp.Server, tool *mcp.Tool, h func(context.Context, *mcp.CallToolRequest, In) (Out, error)) {
	if tool.InputSchema == nil {
		tool.InputSchema = schemaFor[In](nil)
	}
	if t.checks == nil {
		t.checks = argChecks{}
	}
	t.checks[tool.Name] = tool.InputSchema.(*jsonschema.Schema)
	mcp.AddTool(s, tool, authed(t, h))
}

// authed runs h as the request's principal and turns fleet errors into tool
// errors that carry the fleet's message (which names the field at fault).
func authed[In, Out any](t *tools, h func(context.Context, *mcp.CallToolRequest, In) (Out, error)) mcp.ToolHandlerFor[In, Out] {
	return func(ctx context.Context, req *mcp.CallToolRequest, in In) (*mcp.CallToolResult, Out, error) {
		var zero Out
		ctx, err := withPrincipal(ctx, req)
		if err != nil {
			return nil, zero, err
		}
		out, err := h(ctx, req, in)
		if err != nil {
			return nil, zero, t.toolError(req, err)
		}
		return nil, out, nil
	}
}

// toolError keeps the messages meant for callers and hides the rest
// (store and I/O errors), which go to the log instead.
func (t *tools) toolError(req *mcp.CallToolRequest, err error) error {
	var te *toolErr
	switch {
	case errors.As(err, &te):
		return err
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return errors.New(connect.CodeCanceled.String() + ": cancelled")
	}
	// The same code the API answers with (fleet.Kind.Code), as the first word.
	if k := fleet.KindOf(err); k != fleet.Internal {
		return errors.New(k.Code().String() + ": " + err.Error())
	}
	t.log.Error("mcp tool", "tool", req.Params.Name, "err", err)
	return errors.New(connect.CodeInternal.String() + ": internal error (see the control plane's log)")
}

// toolErr is an error this package words for the caller.
type toolErr struct{ msg string }

func (e *toolErr) Error() string { return e.msg }
