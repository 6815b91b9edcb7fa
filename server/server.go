// Package server assembles the control plane: store, fleet, Connect API and
// TLS, served on one port (Connect, gRPC and gRPC-Web; HTTP/2 over TLS, or
// h2c on loopback in dev mode).
package server

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/go-chi/chi/v5"

	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/server/api"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/server/httpguard"
	"github.com/a73x/eitri/server/mcp"
	"github.com/a73x/eitri/server/metrics"
	"github.com/a73x/eitri/server/pki"
	"github.com/a73x/eitri/server/sshca"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/addrpolicy"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/release"
)

// Config is how the control plane is started.
type Config struct {
	DataDir string
	// DB is the database: a postgres:// URL for one that replicas share,
	// or "" for SQLite in DataDir (see store.Open).
	DB string
	// PublicURL is what agents dial (goes into join tokens). Defaults from
	// the listen address.
	PublicURL string
	// AdvertiseURL is this replica's own URL as agents reach it (several
	// replicas): see fleet.Config.AdvertiseURL.
	AdvertiseURL string
	// Plaintext serves h2c instead of TLS; for loopback dev mode only.
	Plaintext bool
	// TLSCert/TLSKey replace the self-made certificate.
	TLSCert, TLSKey string
	// TLSHosts are extra names/IPs for the self-made certificate.
	TLSHosts    []string
	DeleteGrace time.Duration
	// RestoreMargin and DestroySweep: see fleet.Config.
	RestoreMargin, DestroySweep time.Duration
	// MaxTunnelsPerUser: see fleet.Config.
	MaxTunnelsPerUser int
	// Now is the control plane's clock (tests step it); nil is time.Now.
	Now func() time.Time
	// PortMin/PortMax bound the host ports allocated to exposures that do
	// not name one (default 30000-32767).
	PortMin, PortMax uint16
	// Console serves the web console; nil serves a page saying how to build it.
	Console http.Handler
	// Routes adds extra routes (dev mode serves the test guest image).
	Routes func(chi.Router)
	Log    *slog.Logger
	// BodyTimeout and IdleTimeout replace DefaultBodyTimeout and
	// DefaultIdleTimeout (tests shorten them).
	BodyTimeout, IdleTimeout time.Duration
	// ReleaseKey checks uploaded agent builds and goes into join tokens;
	// zero: no builds are taken.
	ReleaseKey release.PublicKey
	// ImagePolicy is what the image catalogue's fetches may connect to
	// (fleet.Config.ImagePolicy).
	ImagePolicy addrpolicy.Policy
	// Version is the control plane's own (agents older than it are shown).
	Version string
	// StuckAfter and RolloutTick: see fleet.Config.
	StuckAfter, RolloutTick time.Duration
}

// Server is a started control plane.
type Server struct {
	Fleet *fleet.Fleet
	Store *store.Store
	// AdminToken is set on the very first start only.
	AdminToken  string
	Fingerprint string
	handler     http.Handler
	tls         *tls.Config
	// stopFollow ends following the other replicas (fleet.FollowReplicas)
	// and waits until it has; Close calls it.
	stopFollow func()
	log        *slog.Logger
	idle       time.Duration
}

// New opens the store, prepares TLS and builds the handler.
func New(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return nil, err
	}
	s := &Server{log: cfg.Log, idle: cmp.Or(cfg.IdleTimeout, DefaultIdleTimeout)}
	db := cfg.DB
	if db == "" {
		db = filepath.Join(cfg.DataDir, "eitri.db")
	}
	st, err := store.Open(ctx, db)
	if err != nil {
		return nil, err
	}
	if cfg.DB != "" {
		cfg.Log.Info("store on PostgreSQL", "db", store.Redact(db))
	}
	s.Store = st
	self := metrics.NewSelf()
	st.Observe(self)
	// One replica at a time: the first to start on an empty database makes
	// the secrets and the first admin, and the others take them.
	err = st.Exclusive(ctx, func() error {
		sec := secrets{st: st, dir: cfg.DataDir, tls: !cfg.Plaintext && cfg.TLSCert == ""}
		if err := sec.pull(ctx); err != nil {
			return err
		}
		if !cfg.Plaintext {
			var cert tls.Certificate
			var err error
			if cfg.TLSCert != "" {
				cert, err = pki.Load(cfg.TLSCert, cfg.TLSKey)
			} else {
				cert, err = pki.LoadOrCreate(filepath.Join(cfg.DataDir, "tls"), cfg.TLSHosts)
			}
			if err != nil {
				return err
			}
			s.Fingerprint = connclient.Fingerprint(cert.Certificate[0])
			s.tls = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}
			sec.warnMissingNames(cert, cfg.TLSHosts, cfg.Log)
		}
		// The SSH CAs sit beside the TLS material, made on first start.
		ca, err := sshca.LoadOrCreate(filepath.Join(cfg.DataDir, "ssh"))
		if err != nil {
			return err
		}
		if err := sec.push(ctx); err != nil {
			return err
		}
		s.Fleet = fleet.New(fleet.Config{
			PublicURL: cfg.PublicURL, AdvertiseURL: cfg.AdvertiseURL, CertFingerprint: s.Fingerprint,
			DeleteGrace: cfg.DeleteGrace, PortMin: cfg.PortMin, PortMax: cfg.PortMax, Log: cfg.Log,
			RestoreMargin: cfg.RestoreMargin, DestroySweep: cfg.DestroySweep, Now: cfg.Now,
			MaxTunnelsPerUser: cfg.MaxTunnelsPerUser,
			ReleaseKey:        cfg.ReleaseKey, Version: cfg.Version, ImagePolicy: cfg.ImagePolicy,
			StuckAfter: cfg.StuckAfter, RolloutTick: cfg.RolloutTick,
			SSHCA:          ca,
			SecretsChanged: sec.push,
			OthersChangedSecrets: func(ctx context.Context) error {
				if err := sec.pull(ctx); err != nil {
					return err
				}
				return ca.Reload()
			},
		}, st)
		if s.AdminToken, err = s.Fleet.Bootstrap(ctx, cfg.DataDir); err != nil {
			return fmt.Errorf("create the first admin: %w", err)
		}
		return nil
	})
	if err != nil {
		st.Close()
		return nil, err
	}
	// Followed as long as the server lives, not just ctx.
	follow, stop := context.WithCancel(context.WithoutCancel(ctx))
	followed := make(chan struct{})
	rolled := make(chan struct{})
	go func() { defer close(followed); s.Fleet.FollowReplicas(follow) }()
	go func() { defer close(rolled); s.Fleet.RunRollouts(follow) }()
	s.stopFollow = func() { stop(); <-followed; <-rolled }

	r := chi.NewRouter()
	r.Get("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	api.Mount(r, s.Fleet, self, cfg.Log)
	api.MountSession(r, s.Fleet)
	api.MountReflection(r)
	// Agents fetch their upgrades here (ranges resume a download).
	api.MountReleases(r, s.Fleet)
	// AI agents: MCP over streamable HTTP, bearer-token auth.
	r.Handle("/mcp", mcp.Handler(s.Fleet, cfg.Log))
	// Prometheus: the whole fleet in one scrape, as the token may see it.
	r.Handle(MetricsPath, metrics.Handler(s.Fleet, s.Fleet.Usage, func() map[string]int {
		return map[string]int{"vms": s.Fleet.VMs.Watchers(), "hosts": s.Fleet.Hosts.Watchers(),
			"exposures": s.Fleet.Exposures.Watchers(), "rollouts": s.Fleet.Rollouts.Watchers(), "images": s.Fleet.Images.Watchers(), "usage": s.Fleet.Usage.Watchers()}
	}, self, cfg.Log))
	if cfg.Routes != nil {
		cfg.Routes(r)
	}
	console := cfg.Console
	if console == nil {
		console = http.HandlerFunc(noConsole)
	}
	r.Handle("/*", httpguard.Console(console))
	guard := &httpguard.Guard{Route: s.route, BodyTimeout: cmp.Or(cfg.BodyTimeout, DefaultBodyTimeout), Log: cfg.Log,
		Refused: func(r *http.Request, code connect.Code) { self.Refused(api.ProcedureLabel(r.URL.Path), code) }}
	s.handler = guard.Wrap(r)
	return s, nil
}

// MaxOpenBody bounds the body of every route anyone may call without a
// credential in its headers: the console's files and /healthz take none,
// and /auth/login's holds one token.
const MaxOpenBody = 16 << 10

// MetricsPath serves the fleet to Prometheus.
const MetricsPath = "/metrics"

// rpcPrefix starts the path of every Connect procedure (/eitri.v1.VMService/…).
const rpcPrefix = "/eitri.v1."

// route says what a request may cost before its handler runs: whether it
// must show a credential first, how large its body may be, and whether its
// body is a stream.
func (s *Server) route(r *http.Request) httpguard.Rule {
	p := r.URL.Path // what Connect dispatches on
	switch {
	case p == eitriv1connect.AgentServiceEnrollProcedure:
		// The join token in the body is the credential.
		return httpguard.Rule{MaxBody: api.MaxEnrollMessage + api.EnvelopeSlack, RPC: true}
	case p == eitriv1connect.AgentServiceSignHostKeyProcedure:
		// Unary: one VM id and one key.
		return httpguard.Rule{Check: s.checkHost, MaxBody: api.MaxUserMessage + api.EnvelopeSlack, RPC: true}
	case strings.HasPrefix(p, "/"+eitriv1connect.AgentServiceName+"/"):
		// Sync lasts as long as the host is up; Connect bounds each report.
		return httpguard.Rule{Check: s.checkHost, Stream: true, RPC: true}
	case p == eitriv1connect.ReleaseServiceUploadReleaseProcedure:
		// A build is large: only an admin may send one, checked before a
		// byte of it is read, and Connect bounds each chunk.
		return httpguard.Rule{Check: s.checkAdmin, MaxBody: fleet.MaxReleaseSize + fleet.MaxSignatureSize + 1<<20, Stream: true, RPC: true}
	case strings.HasPrefix(p, api.ReleasesPath):
		return httpguard.Rule{Check: s.checkHost, MaxBody: MaxOpenBody}
	case p == eitriv1connect.VMServiceOpenTunnelProcedure:
		// A tunnel's body lasts as long as its connection; Connect bounds
		// each message.
		return httpguard.Rule{Check: s.checkUser, Stream: true, RPC: true}
	case strings.HasPrefix(p, rpcPrefix):
		// One request message, also for the Watch streams.
		return httpguard.Rule{Check: s.checkUser, MaxBody: api.MaxUserMessage + api.EnvelopeSlack, RPC: true}
	case api.IsReflection(p):
		// Open (the schema is public) and cheap: a bidi stream of a few
		// short names. Its body is timed like any other, so an idle
		// reflection stream is cut off after the body timeout.
		return httpguard.Rule{MaxBody: MaxOpenBody, RPC: true}
	case p == "/mcp":
		return httpguard.Rule{Check: s.checkBearer, MaxBody: api.MaxUserMessage}
	case p == MetricsPath:
		// A personal access token, as Prometheus sends it (bearer); no
		// cookie. What the token's user may see is what the scrape holds.
		return httpguard.Rule{Check: s.checkBearer, MaxBody: MaxOpenBody}
	default:
		return httpguard.Rule{MaxBody: MaxOpenBody}
	}
}

// checkUser accepts what the API's interceptor would: a personal access
// token as a bearer token, or without an Authorization header the console's
// session cookie (auth.SessionSecret says when a cookie counts). The
// principal rides on the context, so the interceptor does not resolve the
// credential again.
func (s *Server) checkUser(r *http.Request) (context.Context, error) {
	if r.Header.Get("Authorization") == "" {
		if secret := auth.SessionSecret(r); secret != "" {
			p, err := s.Fleet.ResolveSession(r.Context(), secret)
			return authenticated(r, p, err)
		}
	}
	return s.checkBearer(r)
}

// checkBearer accepts a personal access token only (MCP takes no cookie).
func (s *Server) checkBearer(r *http.Request) (context.Context, error) {
	secret := auth.Secret(r.Header)
	if secret == "" {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing credentials: send Authorization: Bearer <token>"))
	}
	p, err := s.Fleet.Resolve(r.Context(), secret)
	return authenticated(r, p, err)
}

func authenticated(r *http.Request, p auth.Principal, err error) (context.Context, error) {
	if err != nil {
		return nil, credentialError(err)
	}
	return auth.WithPrincipal(r.Context(), p), nil
}

// checkHost accepts a host credential (the agent's Sync stream).
func (s *Server) checkHost(r *http.Request) (context.Context, error) {
	cred := auth.Secret(r.Header)
	if cred == "" {
		return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("missing host credential"))
	}
	_, err := s.Fleet.HostByCredential(r.Context(), cred)
	if err != nil && fleet.KindOf(err) == fleet.Unauthenticated {
		return nil, connect.NewError(connect.CodeUnauthenticated, err)
	}
	if err != nil {
		return nil, credentialError(err)
	}
	return r.Context(), nil
}

// checkAdmin is checkUser for a route only admins may use.
func (s *Server) checkAdmin(r *http.Request) (context.Context, error) {
	ctx, err := s.checkUser(r)
	if err != nil {
		return nil, err
	}
	if p, ok := auth.FromContext(ctx); !ok || !p.Admin {
		return nil, connect.NewError(connect.CodePermissionDenied, errors.New("only an admin may do this"))
	}
	return ctx, nil
}

func credentialError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, auth.ErrBadCredential) {
		return connect.NewError(connect.CodeUnauthenticated, err)
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce
	}
	return connect.NewError(connect.CodeInternal, err)
}

func noConsole(w http.ResponseWriter, _ *http.Request) {
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(http.StatusNotFound)
	_, _ = w.Write([]byte("<!doctype html><title>eitri</title><p>The console is not built into this binary. Run <code>make frontend</code> and rebuild, or use the API.</p>\n"))
}

// Handler is the whole HTTP surface (for tests).
func (s *Server) Handler() http.Handler { return s.handler }

// A connection that has been silent for KeepaliveIdle is pinged, and closed
// when no answer comes within KeepaliveTimeout: a vanished host shows
// disconnected within their sum (agents heartbeat every few seconds, so a
// live one is never pinged at all).
const (
	KeepaliveIdle    = 10 * time.Second
	KeepaliveTimeout = 10 * time.Second
)

// Defaults for Config.BodyTimeout and Config.IdleTimeout. A body (one
// request message: at most 64 KiB, 16 KiB unauthenticated) must arrive
// within DefaultBodyTimeout of its headers; a keep-alive connection with no
// request in flight is closed after DefaultIdleTimeout. Streams (Watch*, the
// agent's Sync) are never idle, and their bodies are not timed.
const (
	DefaultBodyTimeout = 10 * time.Second
	DefaultIdleTimeout = 30 * time.Second
	// MaxHeaderBytes bounds what is read before anyone is authenticated: a
	// token, a cookie and the usual headers are a few KiB.
	MaxHeaderBytes = 64 << 10
)

// Serve serves on ln until ctx ends, then shuts down gracefully.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	if a, ok := ln.Addr().(*net.TCPAddr); ok {
		s.Fleet.ReserveControlPort(uint16(a.Port))
	}
	// Requests live under base, not ctx: stopping cancels them with a cause
	// the streams turn into Unavailable (see api.ErrShuttingDown).
	base, stop := context.WithCancelCause(context.WithoutCancel(ctx))
	defer stop(nil)
	srv := &http.Server{
		Handler:           s.handler,
		ReadHeaderTimeout: 10 * time.Second,
		// No ReadTimeout or WriteTimeout: they would cut every stream. The
		// guard gives each body its own deadline instead.
		IdleTimeout:    s.idle,
		MaxHeaderBytes: MaxHeaderBytes,
		Protocols:      new(http.Protocols),
		BaseContext:    func(net.Listener) context.Context { return base },
		HTTP2: &http.HTTP2Config{
			// A host that loses power sends no FIN: without pings its stream
			// would look open forever and keep getting VMs placed on it.
			SendPingTimeout: KeepaliveIdle, PingTimeout: KeepaliveTimeout,
			// HTTP/2 buffers what a client sends up to its flow-control
			// window before any handler runs, so the window is what an
			// unauthenticated stream costs (1 MiB by default: 100 such
			// connections held 100 MiB). 64 KiB holds any user message
			// whole; a large agent report just takes a few more round trips.
			MaxReceiveBufferPerConnection: 64 << 10,
			MaxReceiveBufferPerStream:     64 << 10,
			MaxReadFrameSize:              16 << 10,
		},
	}
	srv.Protocols.SetHTTP1(true)
	if s.tls != nil {
		srv.Protocols.SetHTTP2(true)
		// A copy per listener: net/http adjusts its server's TLS config,
		// and a server may serve several listeners at once.
		cfg := s.tls.Clone()
		srv.TLSConfig = cfg
		ln = tls.NewListener(ln, cfg)
	} else {
		srv.Protocols.SetUnencryptedHTTP2(true)
	}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	// Streams (watches, agents) never finish on their own: end them with
	// their status first, then let Shutdown flush it; Close ends the rest.
	stop(api.ErrShuttingDown)
	shut, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(shut); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		s.log.Warn("shutdown", "err", err)
	}
	_ = srv.Close()
	return nil
}

// Close releases the store.
func (s *Server) Close() error {
	s.stopFollow()
	return s.Store.Close()
}
