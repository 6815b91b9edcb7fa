// Package pgtest runs a throwaway PostgreSQL for tests, from the binaries of
// Debian's postgresql package: one server per test binary, started on first
// use, and a fresh database per test.
//
// A package using it stops the server at the end from its TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(pgtest.Main(m)) }
//
// Without that the server still dies with the test binary (it gets SIGQUIT
// when its parent exits), but its directory under /tmp is left behind.
package pgtest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver
)

// InstallHint is the command that installs what this package needs.
const InstallHint = "apt-get install -y postgresql"

// superuser is the cluster's superuser, which every test database uses.
const superuser = "eitri"

// ErrNoPostgres: PostgreSQL's server binaries are not installed.
var ErrNoPostgres = errors.New("PostgreSQL is not installed (" + InstallHint + ")")

// Server is a running PostgreSQL cluster in a directory of its own,
// reachable only over the unix socket in that directory.
type Server struct {
	Dir  string // data and socket live here; removed by Stop
	Port int    // names the socket (.s.PGSQL.<Port>); nothing listens on TCP
	cmd  *exec.Cmd
	done chan struct{} // closed when the postmaster has exited
	exit error
	// How the postmaster is run, for Restart.
	bin  string
	env  []string
	cred *syscall.Credential
	// admin is a pool on the "postgres" database, for CREATE/DROP DATABASE.
	admin *sql.DB
	n     atomic.Int64 // names databases
}

var shared struct {
	once sync.Once
	srv  *Server
	err  error
}

// DSN returns the URL of a new, empty database on the test binary's
// server (started on first use), owned by a superuser and dropped when t
// ends. Without PostgreSQL installed, t is skipped with the apt-get
// command that installs it.
func DSN(t testing.TB) string {
	t.Helper()
	return database(t, "")
}

// Clone copies the database at dsn (one from DSN, with no connection open
// to it) into a new one, dropped when t ends, and returns the copy's URL: a
// backup to restore, say.
func Clone(t testing.TB, dsn string) string {
	t.Helper()
	u, err := url.Parse(dsn)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return database(t, strings.TrimPrefix(u.Path, "/"))
}

// database makes a database on the shared server, a copy of template (or
// an empty one for ""), dropped when t ends, and returns its URL.
func database(t testing.TB, template string) string {
	t.Helper()
	srv := sharedServer(t)
	name, err := srv.CreateDatabase(context.Background(), template)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if err := srv.DropDatabase(context.Background(), name); err != nil {
			t.Errorf("pgtest: %v", err)
		}
	})
	return srv.DSN(name)
}

func sharedServer(t testing.TB) *Server {
	t.Helper()
	shared.once.Do(func() { shared.srv, shared.err = Start() })
	switch {
	case errors.Is(shared.err, ErrNoPostgres):
		t.Skipf("PostgreSQL is not installed: %s", InstallHint)
	case shared.err != nil:
		t.Fatalf("pgtest: %v", shared.err)
	}
	return shared.srv
}

// Main runs m's tests, then stops the shared server if one was started,
// and returns the exit code.
func Main(m *testing.M) int {
	code := m.Run()
	if shared.srv != nil {
		if err := shared.srv.Stop(); err != nil {
			fmt.Fprintln(os.Stderr, "pgtest:", err)
		}
	}
	return code
}

// binDir finds the newest installed PostgreSQL's bin directory.
func binDir() (string, error) {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	var best string
	bestV := -1
	for _, d := range dirs {
		v, err := strconv.Atoi(filepath.Base(filepath.Dir(d)))
		if err != nil || v <= bestV {
			continue
		}
		if _, err := os.Stat(filepath.Join(d, "postgres")); err == nil {
			best, bestV = d, v
		}
	}
	if best != "" {
		return best, nil
	}
	if p, err := exec.LookPath("postgres"); err == nil {
		return filepath.Dir(p), nil
	}
	return "", ErrNoPostgres
}

// Start initializes a cluster in a new directory and starts its server:
// without durability (fsync off), since a test's data dies with it. As
// root, the server runs as the postgres user, since PostgreSQL refuses to
// run as root.
func Start() (*Server, error) {
	bin, err := binDir()
	if err != nil {
		return nil, err
	}
	var cred *syscall.Credential
	base := os.TempDir()
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root, and no postgres user to run the server as (%s makes one): %w", InstallHint, err)
		}
		uid, _ := strconv.ParseUint(u.Uid, 10, 32)
		gid, _ := strconv.ParseUint(u.Gid, 10, 32)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		// Every directory above the cluster must be searchable by that
		// user; root's TMPDIR may not be.
		base = "/tmp"
	}
	// Short, since a unix socket's path has to fit in 108 bytes.
	dir, err := os.MkdirTemp(base, "eitri-pg-")
	if err != nil {
		return nil, err
	}
	srv := &Server{Dir: dir, done: make(chan struct{})}
	fail := func(err error) (*Server, error) {
		os.RemoveAll(dir)
		return nil, err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return fail(err)
		}
	}
	data := filepath.Join(dir, "data")
	env := []string{"PATH=/usr/bin:/bin", "LC_ALL=C", "TZ=UTC", "HOME=" + dir}

	initdb := exec.Command(filepath.Join(bin, "initdb"), "-D", data, "-U", superuser, "-A", "trust",
		"-E", "UTF8", "--locale=C", "--no-sync")
	initdb.Env, initdb.Dir = env, dir
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	if out, err := initdb.CombinedOutput(); err != nil {
		return fail(fmt.Errorf("initdb: %v\n%s", err, out))
	}

	// A free port only names the socket file, so any number not in use by
	// another socket in this (private) directory does.
	srv.Port = 5432
	srv.bin, srv.env, srv.cred = bin, env, cred
	if err := srv.run(); err != nil {
		if srv.cmd != nil {
			srv.Stop()
		} else {
			os.RemoveAll(dir)
		}
		return nil, err
	}
	return srv, nil
}

// run starts the postmaster on the cluster in s.Dir and waits until it
// answers.
func (s *Server) run() error {
	logPath := filepath.Join(s.Dir, "postgres.log")
	logf, err := os.OpenFile(logPath, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(filepath.Join(s.bin, "postgres"), "-D", filepath.Join(s.Dir, "data"),
		"-k", s.Dir, "-p", strconv.Itoa(s.Port),
		"-c", "listen_addresses=",
		"-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
		"-c", "max_connections=300", "-c", "log_min_messages=warning")
	cmd.Env, cmd.Dir = s.env, s.Dir
	cmd.Stdout, cmd.Stderr = logf, logf
	// SIGQUIT (immediate shutdown) when the test binary dies without
	// stopping it; set after the credentials change, which would clear it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred, Pdeathsig: syscall.SIGQUIT, Setpgid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	s.cmd, s.done = cmd, done
	go func() {
		s.exit = cmd.Wait()
		close(done)
	}()

	if s.admin == nil {
		if s.admin, err = sql.Open("pgx", s.DSN("postgres")); err != nil {
			return err
		}
	}
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err = s.admin.PingContext(ctx)
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-done:
			log, _ := os.ReadFile(logPath)
			return fmt.Errorf("postgres exited (%v):\n%s", s.exit, log)
		case <-time.After(50 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(logPath)
			return fmt.Errorf("postgres not ready after a minute: %v\n%s", err, log)
		}
	}
}

// Restart shuts the server down (fast: every session is ended, as when a
// database server restarts under its clients) and starts it again on the
// same data and socket; what was committed is kept. Clients reconnect on
// their own, or not: that is what a caller tests.
func (s *Server) Restart() error {
	if err := s.shutdown(); err != nil {
		return err
	}
	return s.run()
}

// DSN is the URL of the named database, over the server's socket.
func (s *Server) DSN(database string) string {
	q := url.Values{"host": {s.Dir}, "port": {strconv.Itoa(s.Port)}, "sslmode": {"disable"}}
	return (&url.URL{Scheme: "postgres", User: url.User(superuser), Host: "", Path: "/" + database, RawQuery: q.Encode()}).String()
}

// CreateDatabase makes a new database, a copy of template (or an empty
// one for ""), and returns its name.
func (s *Server) CreateDatabase(ctx context.Context, template string) (string, error) {
	name := fmt.Sprintf("eitri_test_%d", s.n.Add(1))
	q := `CREATE DATABASE ` + quoteIdent(name)
	if template != "" {
		q += ` TEMPLATE ` + quoteIdent(template)
	}
	if _, err := s.admin.ExecContext(ctx, q); err != nil {
		return "", fmt.Errorf("create database %s: %w", name, err)
	}
	return name, nil
}

// DropDatabase drops the database, ending any session still on it.
func (s *Server) DropDatabase(ctx context.Context, name string) error {
	if _, err := s.admin.ExecContext(ctx, `DROP DATABASE IF EXISTS `+quoteIdent(name)+` WITH (FORCE)`); err != nil {
		return fmt.Errorf("drop database %s: %w", name, err)
	}
	return nil
}

// Stop shuts the server down (fast: sessions are ended) and removes its
// directory.
func (s *Server) Stop() error {
	if s.admin != nil {
		s.admin.Close()
	}
	return errors.Join(s.shutdown(), os.RemoveAll(s.Dir))
}

// shutdown stops the postmaster (fast shutdown) and waits for it.
func (s *Server) shutdown() error {
	if s.cmd == nil || s.cmd.Process == nil {
		return nil
	}
	select {
	case <-s.done:
		return nil // already gone
	default:
	}
	_ = s.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-s.done:
		return nil
	case <-time.After(15 * time.Second):
		_ = syscall.Kill(-s.cmd.Process.Pid, syscall.SIGKILL)
		<-s.done
		return errors.New("postgres did not stop in 15s; killed")
	}
}

func quoteIdent(s string) string {
	return `"` + strings.ReplaceAll(s, `"`, `""`) + `"`
}
