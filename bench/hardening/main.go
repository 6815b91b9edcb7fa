// Command hardening replays the "one unauthenticated request can take
// gigabytes" attack against a real control plane and prints what it cost:
// it starts `eitri server` (loopback, its own data dir), measures the
// server's resident memory idle, then has N clients, each on its own
// connection (half HTTP/2, half HTTP/1.1), post gzip bombs (1 MiB that
// inflates to 1 GiB) without credentials for a while, sampling RSS from
// /proc/<pid>/status.
//
//	go run ./bench/hardening -bin bin/eitri            # 100 clients, 5 s
//	go test ./bench/hardening -run Flood -v            # the same, asserted
//
// Output is one line of key=value. The test asserts the RSS growth stays
// under 64 MiB.
package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/a73x/eitri/bench/hardening/bomb"
)

func main() {
	bin := flag.String("bin", "bin/eitri", "the eitri binary to attack")
	n := flag.Int("n", 100, "concurrent clients, each on its own connection")
	size := flag.Int("size", 1<<20, "bytes of gzip per request")
	dur := flag.Duration("for", 5*time.Second, "how long to keep the flood up")
	proto := flag.String("proto", "both", "h2, h1, or both (alternating clients)")
	verbose := flag.Bool("v", false, "show the server's output")
	flag.Parse()
	echo := io.Discard
	if *verbose {
		echo = os.Stderr
	}
	dir, err := os.MkdirTemp("", "eitri-hardening-")
	if err != nil {
		fatal(err)
	}
	defer os.RemoveAll(dir)
	srv, err := start(context.Background(), *bin, dir, echo)
	if err != nil {
		fatal(err)
	}
	defer srv.stop()
	res, err := flood(context.Background(), srv, *n, *size, *dur, *proto)
	if err != nil {
		fatal(err)
	}
	fmt.Println(res)
}

func fatal(err error) {
	slog.Error("hardening bench", "err", err)
	os.Exit(1)
}

// server is a running `eitri server`.
type server struct {
	cmd  *exec.Cmd
	url  string
	out  *syncBuffer // everything it wrote to stdout and stderr
	done chan struct{}
}

var listening = regexp.MustCompile(`msg="control plane listening" addr=(\S+)`)

// start runs `bin server` on a loopback port with dataDir, copies its output
// to echo as well, and returns once it answers /healthz.
func start(ctx context.Context, bin, dataDir string, echo io.Writer) (*server, error) {
	cmd := exec.CommandContext(ctx, bin, "server", "--listen", "127.0.0.1:0", "--data-dir", dataDir, "--log-level", "info")
	s := &server{cmd: cmd, out: &syncBuffer{}, done: make(chan struct{})}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() { _ = cmd.Wait(); pw.Close(); close(s.done) }()
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			line := sc.Text()
			s.out.WriteLine(line)
			fmt.Fprintln(echo, line)
			if m := listening.FindStringSubmatch(line); m != nil {
				select {
				case addr <- m[1]:
				default:
				}
			}
		}
	}()
	select {
	case a := <-addr:
		s.url = "https://" + a
	case <-s.done:
		return nil, fmt.Errorf("eitri server exited: %s", s.out.String())
	case <-time.After(30 * time.Second):
		s.stop()
		return nil, fmt.Errorf("eitri server did not say where it listens: %s", s.out.String())
	}
	c := client(true)
	defer c.CloseIdleConnections()
	for deadline := time.Now().Add(10 * time.Second); ; {
		resp, err := c.Get(s.url + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s, nil
			}
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("eitri server does not answer /healthz: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (s *server) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(10 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
}

// rss reads a VmRSS-like field of /proc/<pid>/status, in bytes.
func (s *server) rss(field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, s.cmd.Process.Pid)
}

// client is a fresh transport (so its own connection) to the server's
// self-made certificate: loopback, our own server.
func client(h2 bool) *http.Client {
	tr := &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}, Protocols: new(http.Protocols)}
	if h2 {
		tr.Protocols.SetHTTP2(true)
	} else {
		tr.Protocols.SetHTTP1(true)
	}
	return &http.Client{Transport: tr, Timeout: 30 * time.Second}
}

// target is one route the flood hits, with the headers of its protocol.
type target struct {
	path   string
	header map[string]string
	frame  bool // gRPC framing: a 5-byte prefix, flag 1 (compressed)
}

var targets = []target{
	{"/eitri.v1.VMService/CreateVM", map[string]string{"Content-Type": "application/proto", "Content-Encoding": "gzip"}, false},
	{"/eitri.v1.AgentService/Sync", map[string]string{"Content-Type": "application/grpc", "Grpc-Encoding": "gzip", "Te": "trailers"}, true},
	{"/eitri.v1.AgentService/Enroll", map[string]string{"Content-Type": "application/json", "Content-Encoding": "gzip"}, false},
	{"/mcp", map[string]string{"Content-Type": "application/json", "Content-Encoding": "gzip"}, false},
	{"/auth/login", map[string]string{"Content-Type": "application/json", "Content-Encoding": "gzip"}, false},
}

// result is what one flood cost.
type result struct {
	clients, bombKiB     int
	proto                string
	inflatedMiB          int64
	dur                  time.Duration
	requests, failed     int64
	idle, peak, hwmAfter int64
	answers              map[string]int64 // "path status" → count
}

func (r result) growth() int64 { return r.peak - r.idle }

func (r result) String() string {
	var ans []string
	for k, v := range r.answers {
		ans = append(ans, fmt.Sprintf("%s:%d", k, v))
	}
	sort.Strings(ans)
	mib := func(b int64) string { return fmt.Sprintf("%.1f", float64(b)/(1<<20)) }
	return fmt.Sprintf("clients=%d proto=%s bomb_kib=%d inflates_to_mib=%d duration=%s requests=%d failed=%d idle_rss_mib=%s peak_rss_mib=%s growth_mib=%s vmhwm_mib=%s answers=%s",
		r.clients, r.proto, r.bombKiB, r.inflatedMiB, r.dur.Round(time.Millisecond), r.requests, r.failed,
		mib(r.idle), mib(r.peak), mib(r.growth()), mib(r.hwmAfter), strings.Join(ans, ","))
}

// flood measures the server idle, then keeps n clients posting bombs for
// dur, and returns the numbers.
func flood(ctx context.Context, s *server, n, size int, dur time.Duration, proto string) (result, error) {
	gz, inflated := bomb.Gzip(size)
	framed := append([]byte{1, byte(len(gz) >> 24), byte(len(gz) >> 16), byte(len(gz) >> 8), byte(len(gz))}, gz...)
	res := result{clients: n, proto: proto, bombKiB: len(gz) >> 10, inflatedMiB: inflated >> 20, dur: dur, answers: map[string]int64{}}

	// Warm up what any served request sets up once (TLS, HTTP/2, pools), so
	// "idle" is a server that has served.
	for _, h2 := range []bool{true, false} {
		c := client(h2)
		for _, t := range targets {
			_, _ = post(ctx, c, s.url, t, []byte("{}"))
		}
		c.CloseIdleConnections()
	}
	time.Sleep(time.Second)
	var err error
	if res.idle, err = s.rss("VmRSS"); err != nil {
		return res, err
	}
	res.peak = res.idle

	ctx, cancel := context.WithTimeout(ctx, dur)
	defer cancel()
	var mu sync.Mutex
	var requests, failed atomic.Int64
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			c := client(proto == "h2" || proto == "both" && i%2 == 0)
			defer c.CloseIdleConnections()
			for j := i; ctx.Err() == nil; j++ {
				t := targets[j%len(targets)]
				body := gz
				if t.frame {
					body = framed
				}
				status, err := post(ctx, c, s.url, t, body)
				if ctx.Err() != nil {
					return
				}
				requests.Add(1)
				key := t.path + " " + status
				if err != nil {
					failed.Add(1)
					key = t.path + " error"
				}
				mu.Lock()
				res.answers[key]++
				mu.Unlock()
			}
		})
	}
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
sample:
	for {
		select {
		case <-ctx.Done():
			break sample
		case <-tick.C:
			if v, err := s.rss("VmRSS"); err == nil && v > res.peak {
				res.peak = v
			}
		}
	}
	wg.Wait()
	res.requests, res.failed = requests.Load(), failed.Load()
	res.hwmAfter, _ = s.rss("VmHWM")
	return res, nil
}

// post sends body to t and returns how it was answered: the HTTP status and
// the gRPC status if any.
func post(ctx context.Context, c *http.Client, base string, t target, body []byte) (string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+t.path, bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	for k, v := range t.header {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	status := strconv.Itoa(resp.StatusCode)
	if g := cmpOr(resp.Header.Get("Grpc-Status"), resp.Trailer.Get("Grpc-Status")); g != "" {
		status += "/grpc-" + g
	}
	return status, nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// syncBuffer collects a process's output lines for later inspection.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) WriteLine(line string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b.WriteString(line + "\n")
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// buildEitri builds cmd/eitri into dir (for the test, when EITRI_BIN does
// not name a built one).
func buildEitri(dir string) (string, error) {
	out := filepath.Join(dir, "eitri")
	cmd := exec.Command("go", "build", "-o", out, "github.com/a73x/eitri/cmd/eitri")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", errors.New("go build ./cmd/eitri: " + err.Error() + "\n" + string(b))
	}
	return out, nil
}
