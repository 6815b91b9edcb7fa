package main

// The floor: the cheapest reasonable server on eitri's stack (net/http,
// HTTP/2 over TLS, the same 20 ms pacing) carrying the same changes to the
// same watchers, measured in the same run as the control plane. What it
// costs is what any server on this stack pays per write; eitri's p99 over
// it is eitri's own.

import (
	"bufio"
	"context"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server/pki"
)

const floorTitle = "floor (bare net/http HTTP/2 + TLS, same pacing)"

// floorPace is eitri's watchPace (server/api): a busy stream writes at most
// this often. Copied, not imported: the bench is its own program.
const floorPace = 20 * time.Millisecond

var floorListening = regexp.MustCompile(`^floor listening watch=(\S+) ingest=(\S+)$`)

// floor runs the floor server as a child process (this binary again, so
// /proc measures it as it measures the control plane), feeds it c.hosts
// hosts' narration over one loopback connection and measures it with the
// same watchers.
func floor(ctx context.Context, c config, echo io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	s, found, err := launch(exec.CommandContext(ctx, exe, "-serve-floor"), echo, floorListening)
	if err != nil {
		return err
	}
	defer s.stop()
	var addrs []string
	select {
	case addrs = <-found:
	case <-s.done:
		return fmt.Errorf("floor server exited: %s", s.output())
	case <-time.After(30 * time.Second):
		return fmt.Errorf("floor server did not say where it listens: %s", s.output())
	}
	s.url = "https://" + addrs[1]
	conn, err := net.Dial("tcp", addrs[2])
	if err != nil {
		return err
	}
	defer conn.Close()

	tr := newTracks()
	var reports atomic.Int64
	steps := make([]func(), c.hosts)
	for i := range steps {
		h := &floorHost{conn: conn, tracks: tr, reports: &reports, exp: fmt.Sprintf("exp-h%04d", i)}
		for j := range c.vms {
			h.vms = append(h.vms, fmt.Sprintf("vm-h%04d-v%02d", i, j))
		}
		steps[i] = h.step
	}
	_, err = measure(ctx, c, target{title: floorTitle, who: "floor server", srvs: []*server{s}, urls: []string{s.url}, tr: tr, steps: steps, reports: &reports})
	return err
}

// floorHost narrates as a simHost does (one VM's download, one session
// counter, the same "(#seq)"), but straight to the floor server's ingest.
type floorHost struct {
	conn    net.Conn // shared: a Write of one line pair is not interleaved
	tracks  *tracks
	reports *atomic.Int64
	vms     []string
	exp     string
	seq     uint64 // one step at a time: the narration loop's goroutine
}

func (h *floorHost) step() {
	h.seq++
	vm := h.vms[int(h.seq)%len(h.vms)]
	detail := fmt.Sprintf("downloading image … %d%% (#%d)", h.seq%100, h.seq)
	// The changes leave now: their clocks start here, as at a report.
	now := time.Now()
	h.tracks.sent("vms", vm, h.seq, now, 0)
	h.tracks.sent("exposures", h.exp, h.seq, now, 0)
	// A failed write shows as latest state not delivered.
	_, _ = fmt.Fprintf(h.conn, "v %s %s\ne %s %d\n", vm, detail, h.exp, h.seq)
	h.reports.Add(1)
}

// serveFloor is the child: Watch streams on loopback TLS, changes from a
// line protocol on a second port, until SIGTERM.
func serveFloor() error {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
	defer stop()
	// The control plane's own certificate kind (a CA and a leaf), so the
	// handshakes cost what eitri's do.
	dir, err := os.MkdirTemp("", "eitri-floor-tls-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cert, err := pki.LoadOrCreate(dir, []string{"127.0.0.1"})
	if err != nil {
		return err
	}
	wl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	il, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	h := &hub{feeds: map[string]map[*feed]struct{}{"vms": {}, "exposures": {}}}
	mux := http.NewServeMux()
	mux.Handle("POST "+eitriv1connect.VMServiceWatchVMsProcedure, h.watch(ctx, "vms"))
	mux.Handle("POST "+eitriv1connect.ExposureServiceWatchExposuresProcedure, h.watch(ctx, "exposures"))
	srv := &http.Server{
		Handler:   mux,
		TLSConfig: &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"h2"}},
		Protocols: new(http.Protocols),
	}
	srv.Protocols.SetHTTP2(true)
	errc := make(chan error, 2)
	go func() { errc <- srv.ServeTLS(wl, "", "") }()
	go func() { errc <- h.ingest(il) }()
	fmt.Printf("floor listening watch=%s ingest=%s\n", wl.Addr(), il.Addr())
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	il.Close()
	// The streams end themselves on ctx (with their status); Shutdown
	// waits for them.
	shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return srv.Shutdown(shut)
}

// hub fans each change out to the streams of its kind.
type hub struct {
	mu    sync.Mutex
	feeds map[string]map[*feed]struct{} // kind → its streams
}

// feed is one stream's coalescing queue: the latest frame per object, in
// the order the objects first changed since the last write.
type feed struct {
	mu      sync.Mutex
	pending map[string][]byte
	order   []string
	ready   chan struct{} // 1-buffered: something is pending
}

func (f *feed) offer(id string, frame []byte) {
	f.mu.Lock()
	if _, ok := f.pending[id]; !ok {
		f.order = append(f.order, id)
	}
	f.pending[id] = frame
	f.mu.Unlock()
	select {
	case f.ready <- struct{}{}:
	default:
	}
}

func (f *feed) empty() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.order) == 0
}

// take appends everything pending to buf and empties the queue.
func (f *feed) take(buf []byte) []byte {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, id := range f.order {
		buf = append(buf, f.pending[id]...)
	}
	clear(f.pending)
	f.order = f.order[:0]
	return buf
}

func (h *hub) publish(kind, id string, frame []byte) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for f := range h.feeds[kind] {
		f.offer(id, frame)
	}
}

func (h *hub) join(kind string) *feed {
	f := &feed{pending: map[string][]byte{}, ready: make(chan struct{}, 1)}
	h.mu.Lock()
	h.feeds[kind][f] = struct{}{}
	h.mu.Unlock()
	return f
}

func (h *hub) leave(kind string, f *feed) {
	h.mu.Lock()
	delete(h.feeds[kind], f)
	h.mu.Unlock()
}

// ingest reads the generator's lines — "v <vm id> <status detail>" and
// "e <exposure id> <active sessions>" — and publishes each change encoded
// once, as the frame every stream of its kind shares.
func (h *hub) ingest(ln net.Listener) error {
	for {
		conn, err := ln.Accept()
		if err != nil {
			return nil // closed at shutdown
		}
		go func() {
			defer conn.Close()
			sc := bufio.NewScanner(conn)
			for sc.Scan() {
				kind, rest, _ := strings.Cut(sc.Text(), " ")
				id, val, _ := strings.Cut(rest, " ")
				switch kind {
				case "v":
					h.publish("vms", id, envelope(0, &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_Changed{
						Changed: &eitriv1.VM{Id: id, StatusDetail: val}}}))
				case "e":
					n, _ := strconv.ParseInt(val, 10, 64)
					h.publish("exposures", id, envelope(0, &eitriv1.WatchExposuresResponse{Event: &eitriv1.WatchExposuresResponse_Changed{
						Changed: &eitriv1.Exposure{Id: id, Sessions: &eitriv1.ExposureSessions{Active: n}}}}))
				}
			}
		}()
	}
}

// envelope is m framed as Connect and gRPC both frame a message: a flag
// byte, the length (big-endian uint32), the bytes.
func envelope(flag byte, m proto.Message) []byte {
	b, err := proto.Marshal(m)
	if err != nil {
		panic(err) // our own messages
	}
	out := make([]byte, 5, 5+len(b))
	out[0] = flag
	binary.BigEndian.PutUint32(out[1:], uint32(len(b)))
	return append(out, b...)
}

// watch serves one Watch method over the Connect protocol or gRPC (the
// request's content type says which), with just what the connect-go
// clients need: the request read and ignored (no auth), an empty
// snapshot, then the changes, paced as eitri paces them (server/api
// stream): a change after a quiet spell leaves at once, a busy stream
// writes at most once per floorPace, all that is pending in one Write and
// one Flush.
func (h *hub) watch(ctx context.Context, kind string) http.HandlerFunc {
	snapshot := envelope(0, &eitriv1.WatchVMsResponse{Event: &eitriv1.WatchVMsResponse_Snapshot{Snapshot: &eitriv1.VMList{}}})
	if kind == "exposures" {
		snapshot = envelope(0, &eitriv1.WatchExposuresResponse{Event: &eitriv1.WatchExposuresResponse_Snapshot{Snapshot: &eitriv1.ExposureList{}}})
	}
	return func(w http.ResponseWriter, r *http.Request) {
		ct := r.Header.Get("Content-Type")
		grpc := ct == "application/grpc" || ct == "application/grpc+proto"
		if !grpc && ct != "application/connect+proto" {
			http.Error(w, "the floor speaks proto over Connect or gRPC only", http.StatusUnsupportedMediaType)
			return
		}
		// Server streaming: the request is one enveloped message and the
		// end of the body.
		if _, err := io.Copy(io.Discard, r.Body); err != nil {
			return
		}
		f := h.join(kind)
		defer h.leave(kind, f)

		w.Header().Set("Content-Type", ct) // connect-go wants its own codec back
		if grpc {
			w.Header().Set("Trailer", "Grpc-Status")
		}
		rc := http.NewResponseController(w)
		if _, err := w.Write(snapshot); err != nil {
			return
		}
		if err := rc.Flush(); err != nil {
			return
		}
		end := func() {
			if grpc {
				w.Header().Set("Grpc-Status", "0")
				return
			}
			_, _ = w.Write(append([]byte{2, 0, 0, 0, 2}, "{}"...)) // end of stream, no error
		}

		var last time.Time // when the last batch started
		pause := time.NewTimer(time.Hour)
		defer pause.Stop()
		var buf []byte
		for {
			select {
			case <-r.Context().Done():
				return
			case <-ctx.Done():
				end()
				return
			case <-f.ready:
			}
			if f.empty() { // a signal left over from a batch that took its change
				continue
			}
			if wait := floorPace - time.Since(last); wait > 0 {
				pause.Reset(wait)
				select {
				case <-r.Context().Done():
					return
				case <-ctx.Done():
					end()
					return
				case <-pause.C:
				}
			}
			last = time.Now()
			buf = f.take(buf[:0])
			if _, err := w.Write(buf); err != nil {
				return
			}
			if err := rc.Flush(); err != nil {
				return
			}
		}
	}
}
