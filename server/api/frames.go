package api

import (
	"encoding/binary"
	"mime"
	"net/http"

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

// outgoing is one change as every watcher of it sends it: the message and
// its encodings. A raw-framing stream reaches the bytes through the change
// itself, with no lookup or lock (the first round of profiling found a
// weak-pointer map lookup and a mutex per delivery at ~5% of the control
// plane); a stream that sends through Connect reaches the same bytes
// through sharedWire.
type outgoing struct {
	msg any
	enc *encodings // its own allocation: sharedWire holds it, and must not hold msg
}

// append adds o's envelope to frames. ok is false, and frames unchanged,
// for a message large enough that Connect should compress it.
func (r *rawFramer) append(frames []byte, o *outgoing) (_ []byte, ok bool) {
	m, isProto := o.msg.(proto.Message)
	if !isProto {
		return frames, false
	}
	b, err := o.enc.of(m, r.codec)
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
