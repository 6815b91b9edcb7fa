// Package promtest runs a real Prometheus (Debian's package) for a test:
// as nobody, in a temporary directory, on loopback, scraping one target
// with a bearer token, and answers PromQL through its HTTP API.
package promtest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Server is a running Prometheus.
type Server struct {
	addr string
	logs *logBuffer
}

// Start runs Prometheus scraping target (scheme://host:port, /metrics) every
// interval with token as its bearer credential, and stops it when the test
// ends. It skips the test when Prometheus is not installed.
func Start(t testing.TB, target *url.URL, token string, interval time.Duration) *Server {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Skip("prometheus is not installed (Debian package prometheus)")
	}
	// Not t.TempDir: its parent is private to root, and Prometheus runs as
	// nobody.
	dir, err := os.MkdirTemp("", "eitri-prometheus-")
	must(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	must(t, os.Chmod(dir, 0o777))
	tokFile := filepath.Join(dir, "token")
	must(t, os.WriteFile(tokFile, []byte(token), 0o644))
	tls := ""
	if target.Scheme == "https" {
		tls = "\n    tls_config:\n      insecure_skip_verify: true"
	}
	cfg := fmt.Sprintf(`global:
  scrape_interval: %s
scrape_configs:
  - job_name: eitri
    scheme: %s%s
    authorization:
      credentials_file: %s
    static_configs:
      - targets: ['%s']
`, interval, target.Scheme, tls, tokFile, target.Host)
	cfgFile := filepath.Join(dir, "prometheus.yml")
	must(t, os.WriteFile(cfgFile, []byte(cfg), 0o644))

	addr := freeLoopback(t)
	cmd := exec.Command(bin, "--config.file="+cfgFile, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	cmd.Dir = dir
	if os.Geteuid() == 0 {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	}
	s := &Server{addr: addr, logs: &logBuffer{}}
	cmd.Stdout, cmd.Stderr = s.logs, s.logs
	must(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return s
}

// Query runs an instant PromQL query and returns its value when the result
// is exactly one sample.
func (s *Server) Query(q string) (float64, bool) {
	resp, err := http.Get("http://" + s.addr + "/api/v1/query?query=" + url.QueryEscape(q))
	if err != nil {
		return 0, false
	}
	defer resp.Body.Close()
	var r struct {
		Data struct {
			Result []struct {
				Value [2]any `json:"value"`
			} `json:"result"`
		} `json:"data"`
	}
	if json.NewDecoder(resp.Body).Decode(&r) != nil || len(r.Data.Result) != 1 {
		return 0, false
	}
	var v float64
	str, _ := r.Data.Result[0].Value[1].(string)
	_, err = fmt.Sscan(str, &v)
	return v, err == nil
}

// Logs is what Prometheus wrote so far, for a failure message.
func (s *Server) Logs() string { return s.logs.String() }

// String lets a *Server stand in a failure message's arguments and print
// its logs as of when the message is made.
func (s *Server) String() string { return s.Logs() }

type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func freeLoopback(t testing.TB) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	must(t, err)
	addr := ln.Addr().String()
	must(t, ln.Close())
	return addr
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
