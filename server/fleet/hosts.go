package fleet

import (
	"context"
	"errors"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
	"github.com/a73x/eitri/wire/bounds"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/jointoken"
)

// CreateJoinToken mints a single-use token that enrolls one host.
func (f *Fleet) CreateJoinToken(ctx context.Context, ttl time.Duration) (*eitriv1.CreateJoinTokenResponse, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, err
	}
	if ttl == 0 {
		ttl = time.Hour
	}
	if ttl < 0 || ttl > 7*24*time.Hour {
		return nil, invalid("ttl", "must be between 1s and 168h, got %s", ttl)
	}
	secret := auth.NewSecret("")
	now := f.now()
	jt := store.JoinToken{ID: newID("j"), Hash: auth.Hash(secret), CreatedBy: p.UserID, CreatedAt: now, ExpiresAt: now.Add(ttl)}
	if err := f.st.CreateJoinToken(ctx, jt); err != nil {
		return nil, err
	}
	jtok := &eitriv1.JoinToken{Urls: connclient.SplitURLs(f.cfg.PublicURL), CertFingerprint: f.cfg.CertFingerprint, Secret: secret,
		ReleaseKey: f.cfg.ReleaseKey.String()}
	if len(jtok.Urls) > 0 {
		jtok.Url = jtok.Urls[0] // what an agent that knows one URL dials
	}
	tok := jointoken.Encode(jtok)
	return &eitriv1.CreateJoinTokenResponse{
		Token:     tok,
		ExpiresAt: timestamppb.New(jt.ExpiresAt),
		Command:   "eitri agent --join " + tok,
	}, nil
}

// Enroll spends a join token on a new host and returns its credential.
func (f *Fleet) Enroll(ctx context.Context, r *eitriv1.EnrollRequest) (*eitriv1.EnrollResponse, error) {
	jt, err := jointoken.Decode(r.GetJoinToken())
	if err != nil {
		return nil, invalid("join_token", "%v", err)
	}
	name := r.GetHostname()
	if name == "" {
		return nil, invalid("hostname", "required")
	}
	// 253 is the longest DNS name; both are shown to every user.
	if err := checkLen("hostname", name, 253); err != nil {
		return nil, err
	}
	if err := checkLen("agent_version", r.GetAgentVersion(), 128); err != nil {
		return nil, err
	}
	cred := auth.NewSecret(auth.PrefixHost)
	now := f.now()
	h := store.Host{ID: newID("h"), Name: name, CredentialHash: auth.Hash(cred), AgentVersion: r.GetAgentVersion(), CreatedAt: now}
	switch err := f.st.ConsumeJoinToken(ctx, auth.Hash(jt.GetSecret()), now, h); {
	case errors.Is(err, store.ErrNotFound):
		return nil, errorf(Unauthenticated, "join token is not known to this control plane")
	case errors.Is(err, store.ErrJoinTokenUsed):
		return nil, errorf(Unauthenticated, "join token was already used; create a new one")
	case errors.Is(err, store.ErrJoinTokenExpired):
		return nil, errorf(Unauthenticated, "join token has expired; create a new one")
	case err != nil:
		return nil, err
	}
	f.log.Info("host enrolled", "host", h.ID, "name", name)
	f.publishHost(ctx, h.ID)
	return &eitriv1.EnrollResponse{HostId: h.ID, HostCredential: cred}, nil
}

// HostByCredential authenticates an agent stream.
func (f *Fleet) HostByCredential(ctx context.Context, cred string) (string, error) {
	h, err := f.st.HostByCredentialHash(ctx, auth.Hash(cred))
	if errors.Is(err, store.ErrNotFound) {
		return "", errorf(Unauthenticated, "unknown host credential (was this host decommissioned?)")
	}
	if err != nil {
		return "", err
	}
	return h.ID, nil
}

// ListHosts returns every host.
func (f *Fleet) ListHosts(ctx context.Context) ([]*eitriv1.Host, error) {
	if _, err := principal(ctx); err != nil {
		return nil, err
	}
	hosts, err := f.st.ListHosts(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*eitriv1.Host, 0, len(hosts))
	for _, h := range hosts {
		v, err := f.hostView(ctx, h)
		if err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, nil
}

// GetHost returns one host.
func (f *Fleet) GetHost(ctx context.Context, id string) (*eitriv1.Host, error) {
	if _, err := principal(ctx); err != nil {
		return nil, err
	}
	h, err := f.hostByID(ctx, id)
	if err != nil {
		return nil, err
	}
	return f.hostView(ctx, h)
}

// hostByID reads the host a request names, refusing an empty or oversized
// id before the store is asked.
func (f *Fleet) hostByID(ctx context.Context, id string) (store.Host, error) {
	if id == "" {
		return store.Host{}, invalid("id", "required")
	}
	if err := checkLen("id", id, bounds.MaxIDLen); err != nil {
		return store.Host{}, err
	}
	h, err := f.st.HostByID(ctx, id)
	if err != nil {
		return store.Host{}, storeErr(err, "host "+id)
	}
	return h, nil
}

// DecommissionHost removes an empty host from the fleet and closes its
// stream; its credential stops working.
func (f *Fleet) DecommissionHost(ctx context.Context, id string) error {
	if _, err := requireAdmin(ctx); err != nil {
		return err
	}
	if _, err := f.hostByID(ctx, id); err != nil {
		return err
	}
	vms, err := f.st.ListVMsByHost(ctx, id)
	if err != nil {
		return err
	}
	if len(vms) > 0 {
		if _, connected := f.reg.Host(id); !connected {
			return errorf(Precondition, "host %s still has %d VM(s); delete them first, or decommission it with force if it is gone for good (its VMs are then marked lost)", id, len(vms))
		}
		return errorf(Precondition, "host %s still has %d VM(s); delete them first", id, len(vms))
	}
	if err := f.st.DeleteHost(ctx, id); err != nil {
		if errors.Is(err, store.ErrConflict) {
			return errorf(Precondition, "host %s still has VMs; delete them first", id)
		}
		return storeErr(err, "host "+id)
	}
	f.mu.Lock()
	if s := f.sessions[id]; s != nil {
		s.cancel(errors.New("host decommissioned"))
	}
	f.mu.Unlock()
	f.Hosts.Publish(watch.Event[*eitriv1.Host]{ID: id, Removed: true})
	return nil
}

func (f *Fleet) hostView(ctx context.Context, h store.Host) (*eitriv1.Host, error) {
	alloc, err := f.allocated(ctx, f.st, h.ID)
	if err != nil {
		return nil, err
	}
	out := &eitriv1.Host{
		Id: h.ID, Name: h.Name, Address: h.Address, AgentVersion: h.AgentVersion,
		Accelerator: h.Accelerator, AcceleratorReason: h.AcceleratorReason, Allocated: alloc, CreatedAt: timestamppb.New(h.CreatedAt),
		Conditions: f.conditions(h.ID),
	}
	if h.OS != "" {
		out.Platform = h.OS + "/" + h.Arch
	}
	if h.LastSeenAt != nil {
		out.LastSeenAt = timestamppb.New(*h.LastSeenAt)
	}
	live, connected := f.reg.Host(h.ID)
	var liveUpgrade *eitriv1.AgentUpgradeStatus
	if connected {
		liveUpgrade = live.Report.GetUpgrade()
	}
	var stuck *eitriv1.HostCondition
	out.Upgrade, stuck = f.hostUpgradeView(h, connected, liveUpgrade)
	if stuck != nil {
		out.Conditions = append(out.Conditions, stuck)
	}
	if skew := f.versionSkew(h); skew != nil {
		out.Conditions = append(out.Conditions, skew)
	}
	out.AgentUpdateAvailable = out.Platform != "" && f.newest.newerThan(out.Platform, h.AgentVersion)
	if connected {
		out.Connected = true
		out.LastSeenAt = timestamppb.New(live.LastSeen)
		if hello := live.Hello; hello != nil {
			out.Address, out.AgentVersion = hello.GetAddress(), hello.GetAgentVersion()
			out.Accelerator, out.AcceleratorReason = hello.GetAccelerator(), hello.GetAcceleratorReason()
		}
		if rep := live.Report; rep.GetAccelerator() != "" {
			out.Accelerator, out.AcceleratorReason = rep.GetAccelerator(), rep.GetAcceleratorReason()
		}
		out.Capacity = live.Report.GetCapacity()
		out.Metrics = live.Report.GetMetrics()
	}
	return out, nil
}

func (f *Fleet) publishHost(ctx context.Context, id string) {
	h, err := f.st.HostByID(ctx, id)
	if errors.Is(err, store.ErrNotFound) {
		f.Hosts.Publish(watch.Event[*eitriv1.Host]{ID: id, Removed: true})
		return
	}
	if err != nil {
		return
	}
	v, err := f.hostView(ctx, h)
	if err != nil {
		return
	}
	f.Hosts.Publish(watch.Event[*eitriv1.Host]{ID: id, Obj: v})
}

// WatchHosts subscribes and returns the current list to start from.
func (f *Fleet) WatchHosts(ctx context.Context) (*watch.Watcher[*eitriv1.Host], []*eitriv1.Host, error) {
	if _, err := principal(ctx); err != nil {
		return nil, nil, err
	}
	w := f.Hosts.Subscribe(nil)
	list, err := f.ListHosts(ctx)
	if err != nil {
		w.Close()
		return nil, nil, err
	}
	return w, list, nil
}
