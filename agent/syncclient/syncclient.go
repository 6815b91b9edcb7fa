// Package syncclient keeps the agent's one stream to the control plane up:
// it enrolls with a join token, pins the control plane's certificate, and
// runs AgentService.Sync with backoff and jitter — snapshots in, complete
// reports out (one after every reconnect, on every change, coalesced, and a
// heartbeat otherwise).
package syncclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/jointoken"
)

// HTTPClient is the HTTP/2 client every one of the agent's calls shares:
// pinned to the control plane's certificate, and failing over between its
// replicas when one does not answer.
func HTTPClient(id state.Identity) *http.Client {
	hc, _, err := connclient.Replicas(id.Fingerprint, id.URLs())
	if err != nil {
		// A saved identity's URLs were checked when it was made; this is
		// a hand-edited file. The first URL alone still works.
		return connclient.HTTPClient(id.Fingerprint)
	}
	return hc
}

// Enroll spends a join token and returns this host's identity.
func Enroll(ctx context.Context, token, hostname, version string) (state.Identity, error) {
	jt, err := jointoken.Decode(token)
	if err != nil {
		return state.Identity{}, err
	}
	if err := jointoken.Dialable(jt); err != nil {
		return state.Identity{}, err
	}
	urls := jointoken.URLs(jt)
	hc, base, err := connclient.Replicas(jt.GetCertFingerprint(), urls)
	if err != nil {
		return state.Identity{}, fmt.Errorf("join token: %w", err)
	}
	c := eitriv1connect.NewAgentServiceClient(hc, base)
	resp, err := c.Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: token, Hostname: hostname, AgentVersion: version}))
	if err != nil {
		return state.Identity{}, fmt.Errorf("enroll with %s: %w", strings.Join(urls, ", "), err)
	}
	id := state.Identity{ServerURL: base, Fingerprint: jt.GetCertFingerprint(), HostID: resp.Msg.HostId, Credential: resp.Msg.HostCredential,
		ReleaseKey: jt.GetReleaseKey()}
	if len(urls) > 1 {
		id.ServerURLs = urls
	}
	return id, nil
}

// Source is what the stream reports on and applies snapshots to.
type Source interface {
	Apply(*eitriv1.DesiredStateSnapshot) bool
	Fill(*eitriv1.ActualStateReport)
}

// Config tunes Run.
type Config struct {
	Identity state.Identity
	Source   Source
	Hello    func() *eitriv1.Hello
	// ReportEvery is how often the aggregate is checked for changes; a
	// changed report goes out at the next check, so reports are coalesced to
	// at most 1/ReportEvery per second (default 250ms).
	ReportEvery time.Duration
	// Heartbeat resends an unchanged report this often (default 5s).
	Heartbeat time.Duration
	// MinBackoff/MaxBackoff bound reconnect delays (default 500ms / 30s).
	MinBackoff, MaxBackoff time.Duration
	Log                    *slog.Logger
	// OnSnapshot is told each applied generation (tests, metrics).
	OnSnapshot func(generation uint64)
	// Usage measures the host and its guests; nil sends no samples. It is
	// called every UsageEvery (default 10s) on a goroutine of its own, so a
	// slow measurement never holds up a report.
	Usage      func(context.Context) *eitriv1.UsageSample
	UsageEvery time.Duration
	// ImageCache says what the host's image cache holds; nil sends nothing.
	// It is sent after every (re)connect and, at the next ReportEvery tick,
	// after ImageCacheChanged fires: never with every report, since a
	// cache's listing barely changes.
	ImageCache        func() *eitriv1.ImageCacheReport
	ImageCacheChanged <-chan struct{}
	// Client is the HTTP client to use (nil: connclient.HTTPClient of the identity's
	// pin); share one so the agent's other streams ride the same connection.
	Client *http.Client
}

// refusedBackoff is the shortest wait after the control plane refused the
// stream because another agent holds this host's identity.
const refusedBackoff = 5 * time.Second

// Run keeps the stream up until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if cfg.ReportEvery == 0 {
		cfg.ReportEvery = 250 * time.Millisecond
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 5 * time.Second
	}
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = 500 * time.Millisecond
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 30 * time.Second
	}
	if cfg.UsageEvery == 0 {
		cfg.UsageEvery = 10 * time.Second
	}
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	hc := cfg.Client
	if hc == nil {
		hc = HTTPClient(cfg.Identity)
	}
	client := eitriv1connect.NewAgentServiceClient(hc, cfg.Identity.ServerURL,
		connect.WithInterceptors(connclient.Bearer(cfg.Identity.Credential)))
	backoff := cfg.MinBackoff
	for {
		healthy, err := session(ctx, client, cfg)
		if ctx.Err() != nil {
			return nil
		}
		if healthy {
			backoff = cfg.MinBackoff
		}
		refused := connect.CodeOf(err) == connect.CodeFailedPrecondition
		if refused {
			// Another agent holds this host's stream. Hammering the control
			// plane won't change that; seconds, growing, will let a dead one
			// time out and otherwise keep the noise down.
			backoff = max(backoff, refusedBackoff)
		}
		// Jitter: a control plane restart must not be met by every agent
		// reconnecting in the same instant. Waits stay within
		// [backoff/2, backoff], so MaxBackoff is the longest wait.
		wait := backoff/2 + time.Duration(rand.Int64N(int64(backoff/2)+1))
		if refused {
			var ce *connect.Error
			errors.As(err, &ce)
			cfg.Log.Error("the control plane refused this agent", "reason", ce.Message(), "retry_in", wait.Round(time.Millisecond))
		} else {
			cfg.Log.Warn("control plane stream lost; reconnecting", "err", err, "in", wait.Round(time.Millisecond))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		backoff = min(backoff*2, cfg.MaxBackoff)
	}
}

// session runs one stream. healthy reports that a snapshot arrived, i.e.
// the control plane accepted us, which resets the backoff.
func session(ctx context.Context, client eitriv1connect.AgentServiceClient, cfg Config) (healthy bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st := client.Sync(ctx)
	defer func() {
		_ = st.CloseRequest()
		_ = st.CloseResponse()
	}()
	if err := st.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Hello{Hello: cfg.Hello()}}); err != nil {
		return false, sendErr(st, err)
	}

	recvErr := make(chan error, 1)
	gotSnapshot := make(chan struct{}, 1)
	go func() {
		for {
			msg, err := st.Receive()
			if err != nil {
				recvErr <- err
				return
			}
			if snap := msg.GetSnapshot(); snap != nil {
				if cfg.Source.Apply(snap) && cfg.OnSnapshot != nil {
					cfg.OnSnapshot(snap.GetGeneration())
				}
				select {
				case gotSnapshot <- struct{}{}:
				default:
				}
			}
		}
	}()

	// A change is sent at once while the burst allowance lasts, so a create's
	// quick steps each reach the console; a storm of changes is coalesced to
	// one report per ReportEvery.
	var changed <-chan struct{}
	if c, ok := cfg.Source.(interface{ Changed() <-chan struct{} }); ok {
		changed = c.Changed()
	}
	samples := measure(ctx, cfg)
	lim := newLimiter(8, cfg.ReportEvery)
	tick := time.NewTicker(cfg.ReportEvery)
	defer tick.Stop()
	var last *eitriv1.ActualStateReport
	var lastSent time.Time
	send := func(force bool) error {
		rep := &eitriv1.ActualStateReport{}
		cfg.Source.Fill(rep)
		if !force && last != nil && sameButBytes(rep, last) && time.Since(lastSent) < cfg.Heartbeat {
			return nil
		}
		if err := st.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Report{Report: rep}}); err != nil {
			// The receiving goroutine holds the real cause (see sendErr).
			if errors.Is(err, io.EOF) {
				select {
				case rerr := <-recvErr:
					if rerr != nil && !errors.Is(rerr, io.EOF) {
						return rerr
					}
				case <-time.After(time.Second):
				}
			}
			return err
		}
		last, lastSent = rep, time.Now()
		return nil
	}
	// A full report after every (re)connect: the control plane forgot this
	// host's live state when the last stream ended.
	if err := send(true); err != nil {
		return false, err
	}
	// The cache's listing rides its own frame: after the first report, then
	// coalesced to one per tick whatever the number of changes.
	cacheDirty := cfg.ImageCache != nil
	sendCache := func() error {
		if !cacheDirty {
			return nil
		}
		cacheDirty = false
		return st.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_ImageCache{ImageCache: cfg.ImageCache()}})
	}
	if err := sendCache(); err != nil {
		return false, err
	}
	for {
		select {
		case <-ctx.Done():
			return healthy, ctx.Err()
		case err := <-recvErr:
			return healthy, err
		case <-gotSnapshot:
			if !healthy {
				cfg.Log.Info("connected to the control plane", "urls", cfg.Identity.URLs(), "host", cfg.Identity.HostID)
			}
			healthy = true
			// Applying a snapshot usually changes the aggregate; say so now
			// rather than at the next tick.
			if err := send(false); err != nil {
				return healthy, err
			}
		case <-changed:
			if lim.allow(time.Now()) {
				if err := send(false); err != nil {
					return healthy, err
				}
			}
		case <-cfg.ImageCacheChanged:
			cacheDirty = cfg.ImageCache != nil
		case <-tick.C:
			if err := send(false); err != nil {
				return healthy, err
			}
			if err := sendCache(); err != nil {
				return healthy, err
			}
		case u := <-samples:
			if err := st.Send(&eitriv1.SyncRequest{Msg: &eitriv1.SyncRequest_Usage{Usage: u}}); err != nil {
				return healthy, err
			}
		}
	}
}

// measure takes a usage sample every cfg.UsageEvery until ctx ends. The
// channel holds one: a sample the stream has not taken yet is replaced by
// the newer one.
func measure(ctx context.Context, cfg Config) <-chan *eitriv1.UsageSample {
	out := make(chan *eitriv1.UsageSample, 1)
	if cfg.Usage == nil {
		return out
	}
	go func() {
		t := time.NewTicker(cfg.UsageEvery)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			u := cfg.Usage(ctx)
			if u == nil {
				continue
			}
			select {
			case <-out:
			default:
			}
			out <- u
		}
	}()
	return out
}

// sendErr turns a failed Send, before anything else reads the stream, into
// the stream's real error. connect reports
// a send on a broken stream as io.EOF and keeps the cause (a refused
// certificate, the server's error) for Receive; without this, a pinned
// certificate that doesn't match reads like a server that is down.
func sendErr(st *connect.BidiStreamForClient[eitriv1.SyncRequest, eitriv1.SyncResponse], err error) error {
	if !errors.Is(err, io.EOF) {
		return err
	}
	if _, rerr := st.Receive(); rerr != nil && !errors.Is(rerr, io.EOF) {
		return rerr
	}
	return err
}

// limiter is a token bucket: burst sends at once, then one per every.
type limiter struct {
	tokens, burst float64
	every         time.Duration
	last          time.Time
}

func newLimiter(burst int, every time.Duration) *limiter {
	return &limiter{tokens: float64(burst), burst: float64(burst), every: every}
}

func (l *limiter) allow(now time.Time) bool {
	if !l.last.IsZero() {
		l.tokens = min(l.burst, l.tokens+float64(now.Sub(l.last))/float64(l.every))
	}
	l.last = now
	if l.tokens < 1 {
		return false
	}
	l.tokens--
	return true
}

// sameButBytes says whether a report says nothing new beside last but the
// bytes its published ports carried. Those move with every packet: a port
// carrying steady traffic would send a report every check. They ride
// along with the next report sent anyway (a change, or the heartbeat).
func sameButBytes(rep, last *eitriv1.ActualStateReport) bool {
	if len(rep.GetExposures()) != len(last.GetExposures()) {
		return false
	}
	// Set aside, compare, put back: both reports belong to this loop.
	type aside struct {
		s *eitriv1.ExposureSessions
		b *eitriv1.ExposureBytes
	}
	var kept []aside
	for _, e := range append(rep.GetExposures()[:len(rep.GetExposures()):len(rep.GetExposures())], last.GetExposures()...) {
		if s := e.GetSessions(); s != nil {
			kept = append(kept, aside{s, s.Carried})
			s.Carried = nil
		}
	}
	same := proto.Equal(rep, last)
	for _, k := range kept {
		k.s.Carried = k.b
	}
	return same
}
