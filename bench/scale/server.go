package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/a73x/eitri/wire/connclient"
)

// server is a running `eitri server` on loopback TLS.
type server struct {
	cmd   *exec.Cmd
	url   string
	token string // the first admin's
	done  chan struct{}

	mu    sync.Mutex
	out   strings.Builder
	gcs   []gcLine // from GODEBUG=gctrace=1
	gcOff bool
}

var (
	// gc 12 @3.402s 1%: 0.030+1.2+0.021 ms clock, ..., 4->5->2 MB, 5 MB goal, ...
	gctrace = regexp.MustCompile(`^gc \d+ @\S+ \S+ .* (\d+)->(\d+)->(\d+) MB`)
)

// gcLine is one collection: the heap when it started and what it left live.
type gcLine struct {
	at          time.Time
	start, live int64 // MB
}

// start runs `bin server` with its own data dir on a free loopback port,
// on SQLite in that dir or, with db, on that PostgreSQL (a replica). The
// control plane traces its collections (GODEBUG=gctrace=1), so the bytes it
// allocates are read from outside without any debug endpoint. The first
// admin's token is read when this one made it (token stays empty on a
// replica that found the admin made).
func start(ctx context.Context, bin, dir, db, cpuprofile string, echo io.Writer) (*server, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	args := []string{"server", "--listen", addr, "--public-url", "https://" + addr,
		"--data-dir", dir, "--log-level", "warn", "--port-range", "20000-60000"}
	if db != "" {
		args = append(args, "--db", db)
	}
	cmd := exec.CommandContext(ctx, bin, args...)
	// Ended by ctx, it still shuts down as on a signal (and writes its
	// profile); killed only if it does not.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	if cpuprofile != "" {
		cmd.Env = append(os.Environ(), "EITRI_CPUPROFILE="+cpuprofile)
	}
	s, _, err := launch(cmd, echo, nil)
	if err != nil {
		return nil, err
	}
	s.url = "https://" + addr
	c := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}, Timeout: 5 * time.Second}
	defer c.CloseIdleConnections()
	for deadline := time.Now().Add(30 * time.Second); ; {
		resp, err := c.Get(s.url + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		select {
		case <-s.done:
			return nil, fmt.Errorf("eitri server exited: %s", s.output())
		default:
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("eitri server does not answer /healthz: %v\n%s", err, s.output())
		}
		time.Sleep(50 * time.Millisecond)
	}
	b, err := os.ReadFile(filepath.Join(dir, "admin.token"))
	switch {
	case err == nil:
		s.token = strings.TrimSpace(string(b))
	case db == "" || !errors.Is(err, fs.ErrNotExist):
		s.stop()
		return nil, err
	}
	return s, nil
}

// fingerprint is the SHA-256 of the certificate the server at url presents,
// as agents pin it.
func fingerprint(url string) (string, error) {
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", strings.TrimPrefix(url, "https://"),
		&tls.Config{InsecureSkipVerify: true})
	if err != nil {
		return "", err
	}
	defer conn.Close()
	return connclient.Fingerprint(conn.ConnectionState().PeerCertificates[0].Raw), nil
}

// launch starts cmd with GODEBUG=gctrace=1 and reads its output: the
// collections are kept for allocated, the first line matching ready (if
// any) is handed over on the channel, the rest is kept for error messages
// and echoed.
func launch(cmd *exec.Cmd, echo io.Writer, ready *regexp.Regexp) (*server, <-chan []string, error) {
	if cmd.Env == nil {
		cmd.Env = os.Environ()
	}
	cmd.Env = append(cmd.Env, "GODEBUG=gctrace=1")
	s := &server{cmd: cmd, done: make(chan struct{})}
	found := make(chan []string, 1)
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		return nil, nil, err
	}
	go func() { _ = cmd.Wait(); pw.Close(); close(s.done) }()
	go func() {
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if m := gctrace.FindStringSubmatch(line); m != nil {
				st, _ := strconv.ParseInt(m[1], 10, 64)
				live, _ := strconv.ParseInt(m[3], 10, 64)
				s.mu.Lock()
				s.gcs = append(s.gcs, gcLine{time.Now(), st, live})
				s.mu.Unlock()
				continue
			}
			if ready != nil {
				if m := ready.FindStringSubmatch(line); m != nil {
					ready = nil
					found <- m
				}
			}
			s.mu.Lock()
			if s.out.Len() < 1<<20 {
				s.out.WriteString(line + "\n")
			}
			s.mu.Unlock()
			fmt.Fprintln(echo, line)
		}
	}()
	return s, found, nil
}

func (s *server) output() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.out.String()
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

// usage is the process's CPU time so far (user+system) and resident memory.
func (s *server) usage() (cpu time.Duration, rss int64, err error) {
	pid := s.cmd.Process.Pid
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// Fields after the command name (which may hold spaces): utime is the
	// 14th field of the line, stime the 15th.
	rest := string(b[strings.LastIndexByte(string(b), ')')+2:])
	f := strings.Fields(rest)
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	cpu = time.Duration(ut+st) * time.Second / 100 // USER_HZ
	st2, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return cpu, 0, err
	}
	for line := range strings.Lines(string(st2)) {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			rss = kb << 10
		}
	}
	return cpu, rss, nil
}

// allocated estimates the bytes the control plane allocated between from
// and to: for each pair of consecutive collections in the window, what the
// heap grew to before the second from what the first left live.
func (s *server) allocated(from, to time.Time) (mb int64, gcs int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i := 1; i < len(s.gcs); i++ {
		g := s.gcs[i]
		if g.at.Before(from) || g.at.After(to) {
			continue
		}
		mb += max(0, g.start-s.gcs[i-1].live)
		gcs++
	}
	return mb, gcs
}

// writeCalls is how many write system calls process pid has made (syscw
// in /proc/pid/io), 0 when unreadable. A watch stream's cost is per write
// (wakeups, an HTTP/2 frame, a TLS record, the call itself), so writes per
// second beside the CPU says what each cost.
func writeCalls(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/io", pid))
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "syscw:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return n
		}
	}
	return 0
}

// runWait is how long the threads of process pid have spent runnable but
// waiting for a CPU (the second field of each /proc/pid/task/*/schedstat):
// on a machine shared with other work, latency that no profile of the
// process shows is time it was ready to run and not given a core.
func runWait(pid int) time.Duration {
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/schedstat", pid))
	if err != nil {
		return 0
	}
	var sum int64
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue // the thread ended
		}
		if f := strings.Fields(string(b)); len(f) >= 2 {
			n, _ := strconv.ParseInt(f[1], 10, 64)
			sum += n
		}
	}
	return time.Duration(sum)
}

// warnings counts the lines the server logged at warn or error (it runs
// with --log-level warn) and returns the first few kinds.
func (s *server) warnings() (int, string) {
	n := 0
	seen := map[string]bool{}
	var kinds []string
	for line := range strings.Lines(s.output()) {
		if !strings.Contains(line, "level=WARN") && !strings.Contains(line, "level=ERROR") {
			continue
		}
		n++
		msg := line
		if _, m, ok := strings.Cut(line, "msg="); ok {
			msg = m
			if i := strings.Index(m, " err="); i >= 0 && !strings.HasPrefix(m, "\"") {
				msg = m[:i]
			} else if strings.HasPrefix(m, "\"") {
				if j := strings.Index(m[1:], "\""); j >= 0 {
					msg = m[:j+2]
				}
			}
		}
		msg = strings.TrimSpace(msg)
		if !seen[msg] && len(kinds) < 3 {
			seen[msg] = true
			kinds = append(kinds, msg)
		}
	}
	return n, strings.Join(kinds, "; ")
}
