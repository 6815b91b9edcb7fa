// Package syncclient keeps the agent's one stream to the control plane up:
// it enrolls with a join token, pins the control plane's certificate, and
// runs AgentService.Sync with backoff and jitter — snapshots in, complete
// reports out (one after every reconnect, on every change, coalesced, and a
// heartbeat otherwise).
package syncclient

import (
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"strings"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

const joinPrefix = "eitri_join_"

// ParseJoinToken decodes a pasted join token: "eitri_join_" +
// base64url(binary eitri.v1.JoinToken).
func ParseJoinToken(s string) (*eitriv1.JoinToken, error) {
	raw, ok := strings.CutPrefix(strings.TrimSpace(s), joinPrefix)
	if !ok {
		return nil, errors.New("not an eitri join token (it starts with " + joinPrefix + ")")
	}
	t := &eitriv1.JoinToken{}
	b, err := base64.RawURLEncoding.DecodeString(raw)
	if err != nil || proto.Unmarshal(b, t) != nil || t.GetSecret() == "" || t.GetUrl() == "" {
		return nil, errors.New("join token is damaged; copy it again")
	}
	return t, nil
}

// Identity is what enrolling buys; the agent keeps it durably.
type Identity struct {
	ServerURL, Fingerprint, HostID, Credential string
}

// HTTPClient returns a client that speaks HTTP/2 to the control plane: TLS
// pinned to fingerprint, or h2c when fingerprint is empty.
func HTTPClient(fingerprint string) *http.Client {
	tr := &http.Transport{
		Proxy:             nil, // the control plane is dialed directly, never via a proxy
		ForceAttemptHTTP2: true,
		DialContext:       (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		Protocols:         new(http.Protocols),
		// The control plane may be silent for long (snapshots go out on
		// change only); a ping on an idle connection tells a dead path from a
		// quiet one, so the agent reconnects instead of waiting on TCP.
		HTTP2: &http.HTTP2Config{SendPingTimeout: 10 * time.Second, PingTimeout: 10 * time.Second},
	}
	if fingerprint == "" {
		tr.Protocols.SetUnencryptedHTTP2(true)
	} else {
		tr.Protocols.SetHTTP2(true)
		tr.TLSClientConfig = pinned(fingerprint)
	}
	return &http.Client{Transport: tr}
}

// pinned trusts exactly the certificate with this fingerprint: the join
// token is the trust anchor, not a CA store.
func pinned(fp string) *tls.Config {
	return &tls.Config{
		MinVersion:         tls.VersionTLS12,
		NextProtos:         []string{"h2"},
		InsecureSkipVerify: true, // replaced by the pin below
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			if len(raw) == 0 {
				return errors.New("control plane presented no certificate")
			}
			sum := sha256.Sum256(raw[0])
			if got := hex.EncodeToString(sum[:]); got != fp {
				return fmt.Errorf("control plane certificate %s does not match the pinned %s (wrong server, or its certificate changed)", got, fp)
			}
			return nil
		},
	}
}

// Enroll spends a join token and returns this host's identity.
func Enroll(ctx context.Context, token, hostname, version string) (Identity, error) {
	jt, err := ParseJoinToken(token)
	if err != nil {
		return Identity{}, err
	}
	c := eitriv1connect.NewAgentServiceClient(HTTPClient(jt.GetCertFingerprint()), jt.GetUrl())
	resp, err := c.Enroll(ctx, connect.NewRequest(&eitriv1.EnrollRequest{JoinToken: token, Hostname: hostname, AgentVersion: version}))
	if err != nil {
		return Identity{}, fmt.Errorf("enroll with %s: %w", jt.GetUrl(), err)
	}
	return Identity{ServerURL: jt.GetUrl(), Fingerprint: jt.GetCertFingerprint(), HostID: resp.Msg.HostId, Credential: resp.Msg.HostCredential}, nil
}

// Source is what the stream reports on and applies snapshots to.
type Source interface {
	Apply(*eitriv1.DesiredStateSnapshot) bool
	Fill(*eitriv1.ActualStateReport)
}

// Config tunes Run.
type Config struct {
	Identity Identity
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
	// Client is the HTTP client to use (nil: HTTPClient of the identity's
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
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	hc := cfg.Client
	if hc == nil {
		hc = HTTPClient(cfg.Identity.Fingerprint)
	}
	client := eitriv1connect.NewAgentServiceClient(hc, cfg.Identity.ServerURL,
		connect.WithInterceptors(Bearer(cfg.Identity.Credential)))
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
	lim := newLimiter(8, cfg.ReportEvery)
	tick := time.NewTicker(cfg.ReportEvery)
	defer tick.Stop()
	var last *eitriv1.ActualStateReport
	var lastSent time.Time
	send := func(force bool) error {
		rep := &eitriv1.ActualStateReport{}
		cfg.Source.Fill(rep)
		if !force && last != nil && proto.Equal(rep, last) && time.Since(lastSent) < cfg.Heartbeat {
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
	for {
		select {
		case <-ctx.Done():
			return healthy, ctx.Err()
		case err := <-recvErr:
			return healthy, err
		case <-gotSnapshot:
			if !healthy {
				cfg.Log.Info("connected to the control plane", "url", cfg.Identity.ServerURL, "host", cfg.Identity.HostID)
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
		case <-tick.C:
			if err := send(false); err != nil {
				return healthy, err
			}
		}
	}
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

// Bearer is a client interceptor that sends token as
// "Authorization: Bearer", on unary calls and streams alike.
type Bearer string

func (b Bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}

func (b Bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		c := next(ctx, spec)
		c.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return c
	}
}

func (Bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
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
