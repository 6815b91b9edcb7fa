// Package callrelay relays calls to hosts: serial consoles and tunnels. No
// control plane dials a host. Each host's agent keeps a Calls stream open (a
// CallLine); a console or tunnel request becomes a call sent down it, and
// the agent answers the call on a stream of its own (Console or Tunnel)
// that names the call first. The request and the answer meet in a pending
// call. A host whose Calls stream another replica holds gets the call
// through the database, and answers it at this replica's advertise URL.
//
// The relay decides nothing about who may reach which VM: each request is
// authorized by its caller (an Authorize), and the relay bounds what one
// host and one user may have open.
package callrelay

import (
	"context"
	"crypto/rand"
	"encoding/base32"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
)

// Hosts is what the relay needs to know of the hosts' streams.
type Hosts interface {
	// Instance is the agent process holding the host's Sync stream on
	// this replica ("" if its agent named none); connected is false when
	// no stream of the host's is held here.
	Instance(hostID string) (instance string, connected bool)
	// HeldElsewhere says whether another replica holds the host's stream.
	HeldElsewhere(hostID string) bool
}

// CallStore carries calls between replicas through the database.
type CallStore interface {
	PostCall(ctx context.Context, c store.PostedCall) error
	DropCall(ctx context.Context, id string) error
	TakeCalls(ctx context.Context, hostIDs []string) ([]store.PostedCall, error)
}

// Config is what a Relay works with.
type Config struct {
	Hosts Hosts
	Calls CallStore
	// AdvertiseURL is this replica's own URL, as agents reach it: a host
	// whose stream another replica holds answers this one's calls there.
	// Empty: only hosts held here are reached from here.
	AdvertiseURL string
	// MaxTunnelsPerUser caps each user's open tunnels (default
	// DefaultMaxTunnelsPerUser).
	MaxTunnelsPerUser int
	Now               func() time.Time
	Log               *slog.Logger
}

// Target is the host a request's call goes to, and who makes it.
type Target struct {
	HostID string
	Caller auth.Principal
}

// Authorize finds the host of the VM a request names, refusing a caller
// who may not reach that VM's console or ports.
type Authorize func(ctx context.Context, vmID string) (Target, error)

// Relay is safe for concurrent use.
type Relay struct {
	cfg     Config
	calls   calls
	tunnels tunnelCount
}

// New returns a relay with no host connected.
func New(cfg Config) *Relay {
	if cfg.MaxTunnelsPerUser == 0 {
		cfg.MaxTunnelsPerUser = DefaultMaxTunnelsPerUser
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	return &Relay{cfg: cfg}
}

func (r *Relay) now() time.Time { return r.cfg.Now().UTC() }

// Kind classifies a relay error, for the API to answer it with.
type Kind int

const (
	Invalid Kind = iota + 1
	NotFound
	Conflict
	Precondition
	// Exhausted: a per-host or per-user bound would be exceeded.
	Exhausted
	// Unavailable: the host is not reachable now; trying again later may
	// work.
	Unavailable
)

// Error is a relay error with a message meant for the caller.
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

var idEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// newCallID is call-<16 random base32 chars>: random enough never to
// collide, across replicas too.
func newCallID() string {
	var b [10]byte
	_, _ = rand.Read(b[:])
	return "call-" + strings.ToLower(idEncoding.EncodeToString(b[:]))
}
