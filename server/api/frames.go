package api

import (
	"encoding/binary"
	"mime"
	"net/http"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
)

// rawFramer writes a Watch stream's changes as the envelopes Connect itself
// writes — a flag byte (0: not compressed), the length in 4 bytes, the
// message — which the Connect, gRPC and gRPC-Web protocols share. The
// message bytes are the ones every watcher of the change shares
// (sharedWire), and a batch leaves in one write: per change, a copy, rather
// than Connect's per-message buffers, envelope and write (a third of the
// control plane's CPU per delivered change at 1,000 watchers).
type rawFramer struct {
	w     http.ResponseWriter
	codec string
}

// rawFraming returns the stream's framer, or nil when its messages must go
// through Connect (no flush gate, or a codec this does not frame).
func rawFraming(g *flushGate, conn connect.StreamingHandlerConn) *rawFramer {
	if g == nil {
		return nil
	}
	mt, params, err := mime.ParseMediaType(conn.RequestHeader().Get("Content-Type"))
	if err != nil || len(params) > 0 {
		return nil
	}
	switch mt {
	case "application/grpc", "application/grpc+proto", "application/grpc-web", "application/grpc-web+proto", "application/connect+proto":
		return &rawFramer{w: g, codec: "proto"}
	case "application/grpc+json", "application/grpc-web+json", "application/connect+json":
		return &rawFramer{w: g, codec: "json"}
	}
	return nil
}

// outgoing is one change as every watcher of it sends it: the message and,
// made on first use, its encoding per codec. A stream copies the bytes out
// with no lookup or lock (the first round of profiling found the shared
// encoding cache's weak-pointer map and mutex at ~5% of the control
// plane, paid on every delivery).
type outgoing struct {
	msg       any
	protoOnce sync.Once
	proto     []byte
	protoErr  error
	jsonOnce  sync.Once
	json      []byte
	jsonErr   error
}

func (o *outgoing) encoded(codec string) ([]byte, error) {
	m, ok := o.msg.(proto.Message)
	if !ok {
		return nil, errNotProto(o.msg)
	}
	if codec == "json" {
		o.jsonOnce.Do(func() { o.json, o.jsonErr = marshalJSON.Marshal(m) })
		return o.json, o.jsonErr
	}
	o.protoOnce.Do(func() { o.proto, o.protoErr = proto.MarshalOptions{}.Marshal(m) })
	return o.proto, o.protoErr
}

// append adds o's envelope to frames. ok is false, and frames unchanged,
// for a message large enough that Connect should compress it.
func (r *rawFramer) append(frames []byte, o *outgoing) (_ []byte, ok bool) {
	b, err := o.encoded(r.codec)
	if err != nil || len(b) >= watchCompressMin {
		return frames, false
	}
	frames = append(frames, 0, 0, 0, 0, 0)
	binary.BigEndian.PutUint32(frames[len(frames)-4:], uint32(len(b)))
	return append(frames, b...), true
}

func (r *rawFramer) write(frames []byte) error {
	if len(frames) == 0 {
		return nil
	}
	_, err := r.w.Write(frames)
	return err
}
