package mcp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/modelcontextprotocol/go-sdk/mcp"
	"golang.org/x/time/rate"

	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
)

// Limits bound what one user holds through MCP. An SDK session costs about
// 15 KB and lives until it is closed or idle, so without them one token
// could open sessions until the control plane runs out of memory.
// Zero fields take DefaultLimits'.
type Limits struct {
	// SessionsPerUser is the most sessions one user keeps open. One more
	// closes that user's least recently used session with no call in
	// progress: agents that forget to close theirs keep working, and only
	// their own sessions pay. When every session has a call in progress the
	// new one is refused instead.
	SessionsPerUser int
	// SessionIdle closes a session no request has come to for this long
	// (the SDK's SessionTimeout; a call in progress holds it open).
	SessionIdle time.Duration
	// SessionRate and SessionBurst are a token bucket on one user's new
	// sessions (every POST without an Mcp-Session-Id): eviction bounds the
	// memory, this bounds the work of making and closing them.
	SessionRate  rate.Limit
	SessionBurst int
}

// DefaultLimits: room for a few agents and editors per user, each making a
// session per run.
var DefaultLimits = Limits{
	SessionsPerUser: 16,
	SessionIdle:     5 * time.Minute,
	SessionRate:     rate.Every(time.Second),
	SessionBurst:    20,
}

func (l Limits) withDefaults() Limits {
	d := DefaultLimits
	if l.SessionsPerUser > 0 {
		d.SessionsPerUser = l.SessionsPerUser
	}
	if l.SessionIdle > 0 {
		d.SessionIdle = l.SessionIdle
	}
	if l.SessionRate > 0 {
		d.SessionRate = l.SessionRate
	}
	if l.SessionBurst > 0 {
		d.SessionBurst = l.SessionBurst
	}
	return d
}

// sessionIDHeader is the streamable HTTP transport's session header.
const sessionIDHeader = "Mcp-Session-Id"

// sessionTable is which user holds which MCP session. It is the gate to
// sessions: a request naming a session not in it is refused here, so a
// session is gone for its client the moment it is evicted, whatever the SDK
// is still closing.
type sessionTable struct {
	lim Limits
	log *slog.Logger

	mu    sync.Mutex
	clock uint64 // orders uses, for least recently used
	byID  map[string]*session
	users map[string]*userSessions // user id →
}

type userSessions struct {
	bucket *rate.Limiter
	open   map[string]*session // at most lim.SessionsPerUser
}

type session struct {
	id   string
	user string
	ss   *mcp.ServerSession
	used uint64 // table clock at the last request's start or end
	busy int    // POSTs in progress: a call that must not be cut off
}

func newSessionTable(lim Limits, log *slog.Logger) *sessionTable {
	return &sessionTable{lim: lim, log: log, byID: map[string]*session{}, users: map[string]*userSessions{}}
}

// user returns the user's entry, making it. The caller holds s.mu.
func (s *sessionTable) user(id string) *userSessions {
	u := s.users[id]
	if u == nil {
		u = &userSessions{bucket: rate.NewLimiter(s.lim.SessionRate, s.lim.SessionBurst), open: map[string]*session{}}
		s.users[id] = u
	}
	return u
}

// victim is the user's least recently used session with no call in
// progress, other than keep; nil when there is none. The caller holds s.mu.
func (u *userSessions) victim(keep string) *session {
	var v *session
	for _, o := range u.open {
		if o.busy == 0 && o.id != keep && (v == nil || o.used < v.used) {
			v = o
		}
	}
	return v
}

// limitError is a refusal naming the limit, answered 429 like the API's
// resource_exhausted.
type limitError struct {
	msg        string
	retryAfter time.Duration
}

func (e *limitError) Error() string { return e.msg }

func (s *sessionTable) allBusy(p auth.Principal) *limitError {
	return &limitError{msg: fmt.Sprintf("mcp sessions: %s has %d of %d MCP sessions open, each with a call in progress; "+
		"wait for a call to end, or end a session (DELETE /mcp with its Mcp-Session-Id)", p.Name, s.lim.SessionsPerUser, s.lim.SessionsPerUser)}
}

// admitNew is the check on a request that would make a session: refused
// when the user's sessions are all busy (so there is nothing to evict), or
// past the user's session rate.
func (s *sessionTable) admitNew(p auth.Principal) *limitError {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	u := s.user(p.UserID)
	defer s.prune(now)
	if len(u.open) >= s.lim.SessionsPerUser && u.victim("") == nil {
		return s.allBusy(p)
	}
	r := u.bucket.ReserveN(now, 1)
	if d := r.DelayFrom(now); !r.OK() || d > 0 {
		r.CancelAt(now)
		return &limitError{retryAfter: d, msg: fmt.Sprintf("mcp session rate: %s may open %d MCP sessions at once and then one every %s; "+
			"retry in %ds, or keep using an open session (send its Mcp-Session-Id)", p.Name, s.lim.SessionBurst, every(s.lim.SessionRate), ceilSeconds(d))}
	}
	return nil
}

func every(l rate.Limit) time.Duration {
	if l == rate.Inf || l <= 0 {
		return 0
	}
	return time.Duration(float64(time.Second) / float64(l))
}

// prune forgets users with no sessions and a full bucket, which is the
// same as never having asked, so the map holds only users asking now. The
// caller holds s.mu.
func (s *sessionTable) prune(now time.Time) {
	if len(s.users) <= 64 {
		return
	}
	for id, u := range s.users {
		if len(u.open) == 0 && u.bucket.TokensAt(now) >= float64(s.lim.SessionBurst) {
			delete(s.users, id)
		}
	}
}

// register takes a session the SDK has just made (at its initialize) into
// the table, evicting the user's least recently used idle session when the
// user is at the cap.
func (s *sessionTable) register(ss *mcp.ServerSession, p auth.Principal) error {
	id := ss.ID()
	if id == "" {
		return nil // a stateless request's session: gone with the request
	}
	s.mu.Lock()
	if _, ok := s.byID[id]; ok {
		s.mu.Unlock()
		return nil // initialize sent again on the session
	}
	u := s.user(p.UserID)
	var evict *session
	if len(u.open) >= s.lim.SessionsPerUser {
		if evict = u.victim(id); evict == nil {
			s.mu.Unlock()
			return s.allBusy(p)
		}
		s.forgetLocked(evict)
	}
	s.clock++
	n := &session{id: id, user: p.UserID, ss: ss, used: s.clock}
	s.byID[id] = n
	u.open[id] = n
	s.mu.Unlock()

	if evict != nil {
		s.log.Info("mcp: closed the user's least recently used session to make room",
			"user", p.Name, "session", evict.id, "sessions_per_user", s.lim.SessionsPerUser)
		// In the background: Close waits for the session's requests to
		// drain, and this runs inside the new session's initialize. The
		// table already refuses the old one's requests.
		go func() { _ = evict.ss.Close() }()
	}
	go func() {
		_ = ss.Wait() // closed: by its client, the idle timeout or eviction
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.byID[id] == n {
			s.forgetLocked(n)
		}
	}()
	return nil
}

// forgetLocked drops a session from the table. The caller holds s.mu.
func (s *sessionTable) forgetLocked(n *session) {
	delete(s.byID, n.id)
	if u := s.users[n.user]; u != nil {
		delete(u.open, n.id)
	}
}

// begin marks a request on session id starting, and returns what marks it
// ending; false when the session is not the user's open session.
func (s *sessionTable) begin(id, userID string, call bool) (end func(), ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := s.byID[id]
	if n == nil || n.user != userID {
		return nil, false
	}
	s.clock++
	n.used = s.clock
	if !call {
		return func() {}, true
	}
	n.busy++
	return func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		s.clock++
		n.used = s.clock
		n.busy--
	}, true
}

// middleware registers each session at its initialize, before the SDK
// answers it: a refused session then fails its initialize, and the SDK
// closes a session that never initialized.
func (s *sessionTable) middleware(next mcp.MethodHandler) mcp.MethodHandler {
	return func(ctx context.Context, method string, req mcp.Request) (mcp.Result, error) {
		if method != "initialize" {
			return next(ctx, method, req)
		}
		ss, ok := req.GetSession().(*mcp.ServerSession)
		if !ok {
			return next(ctx, method, req)
		}
		var p auth.Principal
		if ex := req.GetExtra(); ex != nil && ex.TokenInfo != nil {
			p, ok = ex.TokenInfo.Extra[principalKey].(auth.Principal)
		}
		if !ok {
			return nil, errors.New("missing credentials")
		}
		if err := s.register(ss, p); err != nil {
			return nil, err
		}
		return next(ctx, method, req)
	}
}

// gate holds each request to the user's MCP limits: new sessions to the
// session rate and cap, requests to the user's own open sessions, and the
// standalone event stream (GET) to the streams quota, like a Watch.
func (s *sessionTable) gate(f *fleet.Fleet, next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p, _ := auth.FromContext(r.Context()) // authenticate put it there
		id := r.Header.Get(sessionIDHeader)
		switch {
		case id == "" && r.Method == http.MethodPost:
			if le := s.admitNew(p); le != nil {
				writeLimitError(w, le)
				return
			}
		case id != "":
			end, ok := s.begin(id, p.UserID, r.Method == http.MethodPost)
			if !ok {
				writeJSONError(w, http.StatusNotFound, "not_found",
					"mcp session not found: it ended (closed, idle for "+s.lim.SessionIdle.String()+
						", or replaced by a newer session of yours); initialize a new one")
				return
			}
			defer end()
		}
		if r.Method == http.MethodGet {
			release, err := f.OpenStream(r.Context())
			if err != nil {
				if fleet.KindOf(err) != fleet.Exhausted {
					s.log.Error("mcp: open stream", "err", err)
					writeJSONError(w, http.StatusInternalServerError, "internal", "could not count the stream")
					return
				}
				writeLimitError(w, &limitError{msg: err.Error()})
				return
			}
			defer release()
		}
		next.ServeHTTP(w, r)
	})
}

func ceilSeconds(d time.Duration) int { return int(math.Ceil(d.Seconds())) }

func writeLimitError(w http.ResponseWriter, le *limitError) {
	if le.retryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(ceilSeconds(le.retryAfter)))
	}
	writeJSONError(w, http.StatusTooManyRequests, "resource_exhausted", le.msg)
}
