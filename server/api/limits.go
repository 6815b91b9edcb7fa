package api

import (
	"compress/gzip"
	"errors"
	"io"
	"strings"

	"connectrpc.com/connect"

	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server/callrelay"
	"github.com/a73x/eitri/server/imagesource"
)

// Bounds on one message, after decompression. Connect refuses a larger one
// with ResourceExhausted before decoding it; the HTTP layer (see
// server.route) bounds the bytes as sent.
const (
	// MaxUserMessage: the largest call a person makes is a CreateVM with an
	// SSH key, a URL and a few names, a few KiB. 64 KiB leaves room for
	// long keys and JSON escaping and still keeps a caller from costing more
	// than that per request.
	MaxUserMessage = 64 << 10
	// MaxEnrollMessage: Enroll is open to anyone (the join token in its body
	// is the credential), and holds only that token, a hostname and a
	// version string: a few hundred bytes.
	MaxEnrollMessage = 16 << 10
	// MaxReportMessage: one frame of an agent's Sync stream. A complete
	// report for a host with a thousand VMs, their exposures and quarantined
	// records is well under 2 MiB; 8 MiB is headroom for the biggest hosts,
	// and only a host credential can send one.
	MaxReportMessage = 8 << 20
	// MaxTunnelMessage: one tunnel frame, either stream's, carries at most
	// callrelay.MaxTunnelChunk bytes and a few fields.
	MaxTunnelMessage = callrelay.MaxTunnelChunk + 1<<10
	// MaxConsoleMessage: one frame of an agent's Console stream, a chunk
	// of serial output (callrelay.MaxConsoleChunk) with its place in the log,
	// or a short error. A host's answers are streamed chunk by chunk; an
	// 8 MiB frame here would be buffered whole before anything checks it.
	MaxConsoleMessage = callrelay.MaxConsoleChunk + 1<<10
)

// EnvelopeSlack is what the wire adds around one message in a request body:
// a 5-byte frame prefix (gRPC, gRPC-Web, Connect streaming), and gzip's
// header and block overhead when a message does not compress.
const EnvelopeSlack = 1 << 10

// MessageLimit is the decompressed bound for one procedure.
func MessageLimit(procedure string) int64 {
	switch {
	case procedure == eitriv1connect.AgentServiceEnrollProcedure:
		return MaxEnrollMessage
	case procedure == eitriv1connect.AgentServiceTunnelProcedure, procedure == eitriv1connect.VMServiceOpenTunnelProcedure:
		return MaxTunnelMessage
	case procedure == eitriv1connect.AgentServiceConsoleProcedure:
		return MaxConsoleMessage
	case procedure == eitriv1connect.AgentServiceSignHostKeyProcedure:
		// A VM id and one public key.
		return MaxUserMessage
	case strings.HasPrefix(procedure, "/"+eitriv1connect.AgentServiceName+"/"):
		return MaxReportMessage
	case procedure == eitriv1connect.ReleaseServiceUploadReleaseProcedure:
		return MaxReleaseChunk + 1<<10
	case procedure == eitriv1connect.ImageServiceAddImageProcedure:
		// An image's fields and its pinned keyring.
		return imagesource.MaxKeyringBytes + MaxUserMessage
	case IsReflection(procedure):
		return MaxReflectionMessage
	default:
		return MaxUserMessage
	}
}

// messageLimits bounds every procedure's messages, and swaps Connect's gzip
// for one that stops inflating past the bound: Connect otherwise inflates an
// oversized message to the end just to say how large it was, which for a
// bomb is seconds of CPU.
func messageLimits(spec connect.Spec) []connect.HandlerOption {
	limit := MessageLimit(spec.Procedure)
	opts := []connect.HandlerOption{
		connect.WithReadMaxBytes(int(limit)),
		connect.WithCompression("gzip",
			func() connect.Decompressor { return &boundedGzip{limit: limit} },
			func() connect.Compressor { return gzip.NewWriter(io.Discard) }),
	}
	if limit == MaxTunnelMessage {
		// Tunnel bytes go out as they came: an ssh session is encrypted
		// and does not compress, and gzip would cost CPU for every frame.
		opts = append(opts, connect.WithCompressMinBytes(int(limit)+1))
	}
	if spec.StreamType == connect.StreamTypeServer {
		// A Watch stream's changes go out uncompressed: each is a few hundred
		// bytes, encoded once for every watcher, and gzip would run again
		// for each watcher — resetting a compressor costs more than the
		// whole rest of a delivery (two thirds of the control plane's CPU
		// at 1,000 watchers, measured by bench/scale). The starting list is
		// large and sent once per stream, so it still compresses.
		opts = append(opts, connect.WithCompressMinBytes(watchCompressMin))
	}
	return opts
}

// watchCompressMin is the smallest Watch message worth gzip.
const watchCompressMin = 16 << 10

var errInflatesTooFar = errors.New("it inflates past the limit")

// boundedGzip is a gzip reader that yields at most limit+1 bytes (one more
// than a legitimate message, so Connect sees it is too large) and then an
// error.
type boundedGzip struct {
	gz    gzip.Reader
	limit int64
	left  int64
}

func (b *boundedGzip) Read(p []byte) (int, error) {
	if b.left <= 0 {
		return 0, errInflatesTooFar
	}
	if int64(len(p)) > b.left {
		p = p[:b.left]
	}
	n, err := b.gz.Read(p)
	b.left -= int64(n)
	return n, err
}

func (b *boundedGzip) Reset(r io.Reader) error {
	b.left = b.limit + 1
	return b.gz.Reset(r)
}

func (b *boundedGzip) Close() error { return b.gz.Close() }
