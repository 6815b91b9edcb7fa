// Package consolerelay serves the control plane's calls: it keeps
// AgentService.Calls open beside the Sync stream, on the same connection
// and credential, and answers each call on a stream of its own — a
// Console stream for a VM's serial output followed live, or input typed
// into it; a Tunnel stream for a TCP connection to a guest port (see
// tunnel.go). Nothing ever dials the host.
package consolerelay

import (
	"context"
	"errors"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/state"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

// Serial is what the relay needs of the hypervisor.
type Serial interface {
	FollowSerial(ctx context.Context, id string, from qemu.SerialFrom, emit func(qemu.SerialChunk) error) error
	SerialInput(ctx context.Context, id string, data []byte) error
}

// Config wires Run.
type Config struct {
	// Client is the agent's HTTP/2 client to the control plane (the Sync
	// stream's, so calls share its connection and pinned TLS).
	Client     *http.Client
	Identity   state.Identity
	InstanceID string
	Serial     Serial
	// Guests finds a running VM's address on its bridge, for tunnels; nil
	// refuses them.
	Guests GuestAddr
	// PruneImages removes from the host's image cache what nothing wants
	// and says what went; nil refuses prune calls.
	PruneImages func(context.Context) (*eitriv1.ImagesPruned, error)
	Log         *slog.Logger
	// MinBackoff/MaxBackoff bound reconnect delays (default 500ms / 30s).
	MinBackoff, MaxBackoff time.Duration
}

// maxCalls bounds the calls answered at once (the control plane bounds
// them too; this keeps a confused one from costing the host more).
const maxCalls = 256

// Run keeps the Calls stream up until ctx ends.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Log == nil {
		cfg.Log = slog.Default()
	}
	if cfg.MinBackoff == 0 {
		cfg.MinBackoff = 500 * time.Millisecond
	}
	if cfg.MaxBackoff == 0 {
		cfg.MaxBackoff = 30 * time.Second
	}
	client := eitriv1connect.NewAgentServiceClient(cfg.Client, cfg.Identity.ServerURL,
		connect.WithInterceptors(connclient.Bearer(cfg.Identity.Credential)))
	r := &relay{client: client, ident: cfg.Identity, serial: cfg.Serial, guests: cfg.Guests, prune: cfg.PruneImages, log: cfg.Log, slots: make(chan struct{}, maxCalls)}
	backoff := cfg.MinBackoff
	for {
		healthy, err := r.listen(ctx, cfg.InstanceID)
		if ctx.Err() != nil {
			return nil
		}
		if healthy {
			backoff = cfg.MinBackoff
		}
		if connect.CodeOf(err) == connect.CodeUnimplemented {
			// A control plane that predates console relaying: ask again
			// rarely, it may be upgraded.
			backoff = cfg.MaxBackoff
		}
		wait := backoff/2 + time.Duration(rand.Int64N(int64(backoff/2)+1))
		cfg.Log.Debug("console calls stream lost; reconnecting", "err", err, "in", wait.Round(time.Millisecond))
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(wait):
		}
		backoff = min(backoff*2, cfg.MaxBackoff)
	}
}

type relay struct {
	client eitriv1connect.AgentServiceClient
	ident  state.Identity
	// replicas: clients to the other control-plane replicas calls came
	// from, by URL (see api).
	mu       sync.Mutex
	replicas map[string]eitriv1connect.AgentServiceClient
	serial   Serial
	guests   GuestAddr
	prune    func(context.Context) (*eitriv1.ImagesPruned, error)
	log      *slog.Logger
	slots    chan struct{}
}

// listen runs one Calls stream; healthy reports that it was up: it
// carried a call, or lasted (calls may be rare).
func (r *relay) listen(ctx context.Context, instance string) (healthy bool, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := r.client.Calls(ctx, connect.NewRequest(&eitriv1.CallsRequest{InstanceId: instance}))
	if err != nil {
		return false, err
	}
	defer st.Close()
	opened := time.Now()
	defer func() { healthy = healthy || time.Since(opened) > 10*time.Second }()
	for st.Receive() {
		healthy = true
		c := st.Msg()
		select {
		case r.slots <- struct{}{}:
		default:
			r.log.Warn("too many console calls at once; refusing one", "call", c.GetId())
			go r.refuse(context.WithoutCancel(ctx), c, "the host answers too many calls at once")
			continue
		}
		// A call outlives this stream's loss: its own stream carries it.
		go func() {
			defer func() { <-r.slots }()
			if c.GetTunnel() != nil {
				r.tunnel(context.WithoutCancel(ctx), c)
				return
			}
			r.answer(context.WithoutCancel(ctx), c)
		}()
	}
	return healthy, st.Err()
}

// api is where c's answer goes: its own control plane's, or the replica
// that made the call (answer_url), when this agent may trust that URL with
// its credential: over TLS pinned to the control plane's certificate
// (which only a replica holds), or a URL it enrolled with. Anything else
// is answered on the Calls stream's own connection, where a replica that
// did not make the call refuses it.
func (r *relay) api(c *eitriv1.CallsResponse) eitriv1connect.AgentServiceClient {
	u := c.GetAnswerUrl()
	if u == "" {
		return r.client
	}
	// A client of its own even for one of the agent's URLs: the shared
	// client fails over between them and could carry the answer to
	// another replica than the one waiting for it.
	known := slices.Contains(r.ident.URLs(), u)
	if !known && (r.ident.Fingerprint == "" || !strings.HasPrefix(u, "https://")) {
		r.log.Warn("a call names a control plane to answer at that this agent does not trust; answering on its own stream", "url", u)
		return r.client
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if api, ok := r.replicas[u]; ok {
		return api
	}
	hc, base, err := connclient.Replicas(r.ident.Fingerprint, []string{u})
	if err != nil {
		return r.client
	}
	api := eitriv1connect.NewAgentServiceClient(hc, base, connect.WithInterceptors(connclient.Bearer(r.ident.Credential)))
	if r.replicas == nil {
		r.replicas = map[string]eitriv1connect.AgentServiceClient{}
	}
	r.replicas[u] = api
	return api
}

// answerStream is one call's Console stream.
type answerStream = connect.BidiStreamForClient[eitriv1.ConsoleRequest, eitriv1.ConsoleResponse]

func (r *relay) open(ctx context.Context, c *eitriv1.CallsResponse) (*answerStream, error) {
	st := r.api(c).Console(ctx)
	if err := st.Send(&eitriv1.ConsoleRequest{CallId: c.GetId()}); err != nil {
		return nil, err
	}
	return st, nil
}

func (r *relay) refuse(ctx context.Context, c *eitriv1.CallsResponse, why string) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if c.GetTunnel() != nil {
		r.refuseTunnel(ctx, c, "unavailable", why)
		return
	}
	st, err := r.open(ctx, c)
	if err != nil {
		return
	}
	_ = st.Send(&eitriv1.ConsoleRequest{ErrorCode: "unavailable", Error: why})
	_ = st.CloseRequest()
	_, _ = st.Receive()
}

// answer serves one call until the control plane ends its stream (output)
// or the input is typed.
func (r *relay) answer(ctx context.Context, c *eitriv1.CallsResponse) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := r.open(ctx, c)
	if err != nil {
		r.log.Debug("cannot answer a console call", "call", c.GetId(), "err", err)
		return
	}
	defer func() {
		_ = st.CloseRequest()
		_ = st.CloseResponse()
	}()
	// The control plane sends nothing; its end of the stream is the caller
	// leaving.
	go func() {
		for {
			if _, err := st.Receive(); err != nil {
				cancel()
				return
			}
		}
	}()
	switch call := c.GetCall().(type) {
	case *eitriv1.CallsResponse_ConsoleOutput:
		o := call.ConsoleOutput
		from := qemu.SerialFrom{Boot: o.GetBoot(), Offset: o.GetOffset(), Tail: int64(o.GetTailBytes()), NoFollow: o.GetNoFollow()}
		err = r.serial.FollowSerial(ctx, o.GetVmId(), from, func(ch qemu.SerialChunk) error {
			return st.Send(&eitriv1.ConsoleRequest{Data: ch.Data, Boot: ch.Boot, Offset: ch.Offset, NewBoot: ch.NewBoot})
		})
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			if o.GetNoFollow() {
				_ = st.Send(&eitriv1.ConsoleRequest{Done: true})
			}
			return
		}
	case *eitriv1.CallsResponse_ConsoleInput:
		in := call.ConsoleInput
		ictx, icancel := context.WithTimeout(ctx, 10*time.Second)
		err = r.serial.SerialInput(ictx, in.GetVmId(), in.GetData())
		icancel()
		if err == nil {
			_ = st.Send(&eitriv1.ConsoleRequest{Done: true})
			return
		}
	case *eitriv1.CallsResponse_PruneImages:
		if r.prune == nil {
			err = errors.New("this agent keeps no image cache to prune")
			break
		}
		var pruned *eitriv1.ImagesPruned
		if pruned, err = r.prune(ctx); err == nil {
			_ = st.Send(&eitriv1.ConsoleRequest{Done: true, ImagesPruned: pruned})
			return
		}
	default:
		err = errors.New("this agent does not know that call; upgrade it")
	}
	_ = st.Send(&eitriv1.ConsoleRequest{ErrorCode: errorCode(err), Error: err.Error()})
}

func errorCode(err error) string {
	switch {
	case errors.Is(err, qemu.ErrUnknownVM):
		return "not_found"
	case errors.Is(err, qemu.ErrNotRunning), errors.Is(err, qemu.ErrNoSerialInput):
		return "failed_precondition"
	default:
		return "unavailable"
	}
}
