// Package fleet is the control plane's domain: it validates and authorizes
// requests, places VMs, writes the store, derives what the API serves from
// the durable rows and the hosts' live reports, and tells the watch hub and
// the host streams what changed. The Connect handlers in server/api stay thin
// around it.
package fleet

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"
	"time"

	"connectrpc.com/connect"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/callrelay"
	"github.com/a73x/eitri/server/registry"
	"github.com/a73x/eitri/server/sshca"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/usage"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/addrpolicy"
	"github.com/a73x/eitri/wire/release"
)

// Kind classifies a domain error; the API maps each to a Connect code.
type Kind int

const (
	Internal Kind = iota
	Invalid
	NotFound
	Conflict
	Denied
	Precondition
	Unauthenticated
	// Exhausted: a quota or cap would be exceeded.
	Exhausted
	// Unavailable: a host the request needs is not reachable now; trying
	// again later may work.
	Unavailable
)

// codes are the Connect codes each kind of error is answered with, by the
// API and (as the first word of a tool error) by MCP alike, so both kinds of
// caller read the same meaning.
var codes = map[Kind]connect.Code{
	Internal:        connect.CodeInternal,
	Invalid:         connect.CodeInvalidArgument,
	NotFound:        connect.CodeNotFound,
	Conflict:        connect.CodeAlreadyExists,
	Denied:          connect.CodePermissionDenied,
	Precondition:    connect.CodeFailedPrecondition,
	Unauthenticated: connect.CodeUnauthenticated,
	Exhausted:       connect.CodeResourceExhausted,
	Unavailable:     connect.CodeUnavailable,
}

// Code is the Connect code for an error of this kind. An Internal error's
// message is not for callers: they get the code alone.
func (k Kind) Code() connect.Code {
	if c, ok := codes[k]; ok {
		return c
	}
	return connect.CodeInternal
}

// Error is a domain error with a message meant for the caller.
type Error struct {
	Kind Kind
	Msg  string
}

func (e *Error) Error() string { return e.Msg }

func errorf(k Kind, format string, args ...any) error {
	return &Error{Kind: k, Msg: fmt.Sprintf(format, args...)}
}

// invalid names the field at fault, so a caller can fix the right input.
func invalid(field, format string, args ...any) error {
	return &Error{Kind: Invalid, Msg: field + ": " + fmt.Sprintf(format, args...)}
}

// relayKinds are the kinds of the call relay's errors.
var relayKinds = map[callrelay.Kind]Kind{
	callrelay.Invalid:      Invalid,
	callrelay.NotFound:     NotFound,
	callrelay.Conflict:     Conflict,
	callrelay.Precondition: Precondition,
	callrelay.Exhausted:    Exhausted,
	callrelay.Unavailable:  Unavailable,
}

// KindOf returns err's kind (Internal for anything unclassified). The call
// relay's errors are classified as the fleet's own, so a caller of either
// reads them alike.
func KindOf(err error) Kind {
	var e *Error
	if errors.As(err, &e) {
		return e.Kind
	}
	var re *callrelay.Error
	if errors.As(err, &re) {
		if k, ok := relayKinds[re.Kind]; ok {
			return k
		}
	}
	return Internal
}

// Config tunes the fleet.
type Config struct {
	// AdvertiseURL is this replica's own URL, as agents reach it: a host
	// whose stream another replica holds answers this one's console and
	// tunnel calls there. Empty: only hosts held here get consoles here.
	AdvertiseURL string
	// PublicURL is what agents dial; it goes into join tokens. Several
	// replicas (or load balancers) are a comma-separated list, the first
	// the one an old agent dials.
	PublicURL string
	// CertFingerprint is the serving certificate's pin; empty for plain h2c
	// (dev mode on loopback).
	CertFingerprint string
	// DeleteGrace is how long a deleted VM stays restorable (default 24h).
	DeleteGrace time.Duration
	// RestoreMargin closes restores this long before destroy_at (default
	// 1m, at most a tenth of DeleteGrace), so a restore never races the
	// destroy going out and a console a little behind still tells the truth.
	RestoreMargin time.Duration
	// DestroySweep is how often a connected host's deleted VMs are checked
	// against destroy_at, to send the destroy (default 15s).
	DestroySweep time.Duration
	// PortRange is where unset host ports are allocated from.
	PortMin, PortMax uint16
	// SSHCA signs users' and guests' SSH keys; nil: no certificates, and
	// guests trust no CA.
	SSHCA *sshca.Authority
	// SecretsChanged is told after this replica rotated a CA, to share it
	// with the other replicas; OthersChangedSecrets after another replica
	// did, to take it. Nil: one control plane, nothing to share.
	SecretsChanged, OthersChangedSecrets func(context.Context) error
	// MaxTunnelsPerUser caps each user's open tunnels (default
	// callrelay.DefaultMaxTunnelsPerUser).
	MaxTunnelsPerUser int
	// ReleaseKey checks uploaded agent builds, and join tokens carry it to
	// new agents; zero: no builds are taken, and agents learn no key here.
	ReleaseKey release.PublicKey
	// ImagePolicy is what the image catalogue's fetches (SUMS files,
	// signatures, the image hashed once) may connect to; the zero policy
	// admits public addresses only, as hosts' image downloads do.
	ImagePolicy addrpolicy.Policy
	// Version is this control plane's own, to show agents older than it.
	Version string
	// StuckAfter is how long a connected host may stay on its old version
	// after an upgrade offer before it shows stuck (default
	// DefaultStuckAfter).
	StuckAfter time.Duration
	// RolloutTick is how often the rollout loop looks again without being
	// woken (default 2s).
	RolloutTick time.Duration
	Log         *slog.Logger
	Now         func() time.Time
}

// Fleet is safe for concurrent use.
type Fleet struct {
	cfg Config
	st  *store.Store
	reg *registry.Registry
	log *slog.Logger

	VMs       *watch.Topic[*eitriv1.VM]
	Hosts     *watch.Topic[*eitriv1.Host]
	Exposures *watch.Topic[*eitriv1.Exposure]
	// Images is the catalogue and how its pulls stand (imagewatch.go).
	Images *watch.Topic[*eitriv1.Image]
	// Usage is the recent usage hosts pushed (usage.go).
	Usage *usage.Store
	// Relay carries consoles and tunnels to the hosts; the fleet
	// authorizes each user's request before it goes there (relay.go).
	Relay *callrelay.Relay

	mu       sync.Mutex
	sessions map[string]*Session // host id → current stream
	lineage  store.Lineage       // the newest issued, for checking agents cheaply
	touched  map[string]time.Time
	dups     map[string]*duplicate // host id → a refused second agent

	quota    quotaState
	reserved *reservedPorts

	creds credStreams // open streams by credential, ended on revoke

	published published // the rows watchers last heard, for narration

	tunnelEvents tunnelEvents // tunnels the VMs' timelines heard of (tunnelevents.go)

	userCerts certLimits // SSH certificates per user (sshcerts.go)
	caLines   keyLines   // parsed user CA lines, for every VM view (sshcerts.go)

	replicas replicas // the other replicas sharing the database (replicas.go)

	Rollouts    *watch.Topic[*eitriv1.Rollout]
	rollouts    rollouts       // the newest rollout (rollouts.go)
	newest      newestReleases // the newest build per platform (releases.go)
	lastRelease cachedRelease  // the build hosts are downloading (releases.go)
}

// New returns a fleet over st.
func New(cfg Config, st *store.Store) *Fleet {
	if cfg.DeleteGrace == 0 {
		cfg.DeleteGrace = 24 * time.Hour
	}
	if cfg.RestoreMargin == 0 {
		cfg.RestoreMargin = min(time.Minute, cfg.DeleteGrace/10)
	}
	if cfg.DestroySweep == 0 {
		cfg.DestroySweep = 15 * time.Second
	}
	if cfg.PortMin == 0 {
		cfg.PortMin, cfg.PortMax = 30000, 32767
	}
	if cfg.StuckAfter == 0 {
		cfg.StuckAfter = DefaultStuckAfter
	}
	if cfg.RolloutTick == 0 {
		cfg.RolloutTick = 2 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	f := &Fleet{
		cfg:       cfg,
		st:        st,
		reg:       registry.New(),
		log:       cfg.Log,
		VMs:       watch.NewTopic[*eitriv1.VM](),
		Hosts:     watch.NewTopic[*eitriv1.Host](),
		Exposures: watch.NewTopic[*eitriv1.Exposure](),
		Images:    watch.NewTopic[*eitriv1.Image](),
		Usage:     usage.New(0, 0),
		sessions:  make(map[string]*Session),
		touched:   make(map[string]time.Time),
		dups:      make(map[string]*duplicate),
		reserved:  builtinReserved(cfg.PublicURL),
		replicas:  replicas{flush: make(chan struct{}, 1)},
		Rollouts:  watch.NewTopic[*eitriv1.Rollout](),
		rollouts:  rollouts{wake: make(chan struct{}, 1)},
	}
	f.Relay = callrelay.New(callrelay.Config{
		Hosts:             relayHosts{f},
		Calls:             st,
		AdvertiseURL:      cfg.AdvertiseURL,
		MaxTunnelsPerUser: cfg.MaxTunnelsPerUser,
		Now:               f.now,
		Log:               cfg.Log,
	})
	return f
}

func (f *Fleet) now() time.Time { return f.cfg.Now().UTC() }

// storeErr maps store sentinels to domain errors; what names the object.
func storeErr(err error, what string) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, store.ErrNotFound):
		return errorf(NotFound, "%s not found", what)
	case errors.Is(err, store.ErrConflict):
		return &Error{Kind: Conflict, Msg: err.Error()}
	default:
		return err
	}
}

// Bootstrap makes the first admin on an empty store, writes its token to
// dataDir/admin.token (0600) and returns it; on a store that has users it
// returns "".
func (f *Fleet) Bootstrap(ctx context.Context, dataDir string) (string, error) {
	n, err := f.st.CountUsers(ctx)
	if err != nil || n > 0 {
		return "", err
	}
	u := store.User{ID: newID("u"), Name: "admin", Admin: true, CreatedAt: f.now()}
	if err := f.st.CreateUser(ctx, u); err != nil {
		return "", err
	}
	secret := auth.NewSecret(auth.PrefixPAT)
	if err := f.st.CreateToken(ctx, store.Token{
		ID: newID("t"), UserID: u.ID, Name: "bootstrap", Kind: "pat",
		Hash: auth.Hash(secret), CreatedAt: f.now(),
	}); err != nil {
		return "", err
	}
	path := filepath.Join(dataDir, "admin.token")
	if err := os.WriteFile(path, []byte(secret+"\n"), 0o600); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	return secret, nil
}

func principal(ctx context.Context) (auth.Principal, error) {
	p, ok := auth.FromContext(ctx)
	if !ok {
		return auth.Principal{}, errorf(Unauthenticated, "missing credentials")
	}
	return p, nil
}

// ownerScope is the owner id a listing is limited to: the caller's own, or
// "" (everyone's) for an admin.
func ownerScope(p auth.Principal) string {
	if p.Admin {
		return ""
	}
	return p.UserID
}

func requireAdmin(ctx context.Context) (auth.Principal, error) {
	p, err := principal(ctx)
	if err != nil {
		return p, err
	}
	if !p.Admin {
		return p, errorf(Denied, "only an admin may do this")
	}
	return p, nil
}
