package api

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

// plainText refuses a person's request whose text holds a NUL byte, with
// invalid_argument naming the field. PostgreSQL cannot store NUL in text,
// SQLite's C API cuts strings at it, and no name, URL or key has one, so a
// NUL is either a mistake or an attack on whatever reads the field later
// (a migration to PostgreSQL once rolled back whole on one such token
// name). Invalid UTF-8 never gets this far: the protobuf and JSON codecs
// refuse it in string fields. Bytes fields (a console's keystrokes) are
// bytes and are left alone. Hosts' messages are cleaned where they enter
// (package intake), not refused, so that a report's facts still land.
type plainText struct{}

func (plainText) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !fromHost(req.Spec().Procedure) {
			if err := refuseNUL(req.Any()); err != nil {
				return nil, err
			}
		}
		return next(ctx, req)
	}
}

func (plainText) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (plainText) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if fromHost(conn.Spec().Procedure) {
			return next(ctx, conn)
		}
		return next(ctx, plainConn{conn})
	}
}

func fromHost(procedure string) bool {
	return strings.HasPrefix(procedure, "/"+eitriv1connect.AgentServiceName+"/")
}

// plainConn checks each message a stream receives.
type plainConn struct{ connect.StreamingHandlerConn }

func (c plainConn) Receive(msg any) error {
	if err := c.StreamingHandlerConn.Receive(msg); err != nil {
		return err
	}
	return refuseNUL(msg)
}

func refuseNUL(msg any) error {
	m, ok := msg.(proto.Message)
	if !ok {
		return nil
	}
	if path := nulAt(m.ProtoReflect(), ""); path != "" {
		return connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("%s: contains a NUL byte, which no text field may hold", path))
	}
	return nil
}

// nulAt returns the path of the first string field under m holding a NUL
// ("name", "limits.vms", "urls[2]"), or "".
func nulAt(m protoreflect.Message, prefix string) string {
	var found string
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		path := prefix + string(fd.Name())
		switch {
		case fd.IsList():
			l := v.List()
			for i := range l.Len() {
				if found = nulInValue(fd, l.Get(i), path+"["+strconv.Itoa(i)+"]"); found != "" {
					return false
				}
			}
		case fd.IsMap():
			v.Map().Range(func(k protoreflect.MapKey, mv protoreflect.Value) bool {
				at := path + "[" + strconv.Quote(k.String()) + "]"
				if fd.MapKey().Kind() == protoreflect.StringKind && strings.IndexByte(k.String(), 0) >= 0 {
					found = path
				} else {
					found = nulInValue(fd.MapValue(), mv, at)
				}
				return found == ""
			})
		default:
			found = nulInValue(fd, v, path)
		}
		return found == ""
	})
	return found
}

func nulInValue(fd protoreflect.FieldDescriptor, v protoreflect.Value, path string) string {
	switch fd.Kind() {
	case protoreflect.StringKind:
		if strings.IndexByte(v.String(), 0) >= 0 {
			return path
		}
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return nulAt(v.Message(), path+".")
	}
	return ""
}
