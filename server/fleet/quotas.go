package fleet

import (
	"context"
	"errors"
	"slices"
	"sync"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/bounds"
	"github.com/a73x/eitri/wire/vmstate"
)

// BuiltinQuota is what binds a user when neither the user nor the defaults
// set a limit: room for real work, not for one user to fill a fleet.
var BuiltinQuota = Usage{VMs: 20, VCPUs: 64, MemMB: 128 << 10, DiskGB: 2 << 10, Exposures: 64, Streams: 64}

// Usage is a count of what quotas limit, in QuotaLimits' units.
type Usage struct {
	VMs, VCPUs, MemMB, DiskGB, Exposures, Streams int64
}

// quotaNames are the limits' names as the API spells them, in Usage order.
var quotaNames = []string{"vms", "vcpus", "mem_mb", "disk_gb", "exposures", "streams"}

func (u *Usage) fields() []*int64 {
	return []*int64{&u.VMs, &u.VCPUs, &u.MemMB, &u.DiskGB, &u.Exposures, &u.Streams}
}

// quotaState is the fleet's in-memory quota bookkeeping.
type quotaState struct {
	// admit serializes the check-then-write of everything a quota or a
	// host's capacity limits, so two concurrent requests cannot both take
	// the last slot.
	admit sync.Mutex

	mu      sync.Mutex
	streams map[string]int64 // user id → open Watch streams
}

// vmHolds is what a VM takes from its host and its owner's quota. A create
// that failed for good never built anything and never will (the agent does
// not retry it), so it holds nothing; a deleted VM's guest is stopped but
// its disk is kept until it is destroyed, for a restore. A lost VM's host
// is gone: it holds nothing anywhere.
func vmHolds(v store.VM) (vcpus, memMB, diskGB int64) {
	if v.Status == vmstate.PhaseFailed || v.Status == vmstate.LifecycleLost {
		return 0, 0, 0
	}
	if v.DeletedAt != nil {
		return 0, 0, v.DiskGB
	}
	return int64(v.VCPUs), v.MemMB, v.DiskGB
}

// reader reads what admission checks: the store, or a store.Reader inside
// the write transaction that must find the check still true at commit
// (another replica may be admitting the last slot at the same instant).
type reader interface {
	ListVMs(ctx context.Context, ownerID string) ([]store.VM, error)
	ListVMsByHost(ctx context.Context, hostID string) ([]store.VM, error)
	CountExposuresByOwner(ctx context.Context, ownerID string) (int64, error)
	QuotaDefaults(ctx context.Context) (store.Limits, error)
	UserQuota(ctx context.Context, userID string) (store.Limits, error)
}

// usage counts what the user holds now.
func (f *Fleet) usage(ctx context.Context, rd reader, userID string) (Usage, error) {
	var u Usage
	vms, err := rd.ListVMs(ctx, userID)
	if err != nil {
		return u, err
	}
	for _, v := range vms {
		if v.DeletedAt == nil && v.Status != vmstate.LifecycleLost {
			u.VMs++ // a lost VM runs nowhere; its row waits to be read and deleted
		}
		c, m, d := vmHolds(v)
		u.VCPUs += c
		u.MemMB += m
		u.DiskGB += d
	}
	if u.Exposures, err = rd.CountExposuresByOwner(ctx, userID); err != nil {
		return u, err
	}
	f.quota.mu.Lock()
	u.Streams = f.quota.streams[userID]
	f.quota.mu.Unlock()
	return u, nil
}

// limits returns what binds the user (every field), its own limits and the
// defaults (every field).
func (f *Fleet) limits(ctx context.Context, rd reader, userID string) (eff Usage, own, defaults store.Limits, err error) {
	if defaults, err = rd.QuotaDefaults(ctx); err != nil {
		return
	}
	if own, err = rd.UserQuota(ctx, userID); err != nil {
		return
	}
	eff = BuiltinQuota
	effs, defs, owns := eff.fields(), limitFields(&defaults), limitFields(&own)
	for i := range effs {
		if *defs[i] != nil {
			*effs[i] = **defs[i]
		}
		if *owns[i] != nil {
			*effs[i] = **owns[i]
		}
	}
	return
}

// limitFields lists a store.Limits' fields in Usage order.
func limitFields(l *store.Limits) []**int64 {
	return []**int64{&l.VMs, &l.VCPUs, &l.MemMB, &l.DiskGB, &l.Exposures, &l.Streams}
}

// admitQuota refuses a request that would take the user past a limit; need
// is what the request adds. The caller holds f.quota.admit.
func (f *Fleet) admitQuota(ctx context.Context, rd reader, p auth.Principal, need Usage) error {
	eff, _, _, err := f.limits(ctx, rd, p.UserID)
	if err != nil {
		return err
	}
	have, err := f.usage(ctx, rd, p.UserID)
	if err != nil {
		return err
	}
	needs, haves, limits := need.fields(), have.fields(), eff.fields()
	for i, n := range needs {
		if *n > 0 && *haves[i]+*n > *limits[i] {
			return errorf(Exhausted, "quota: %s: this needs %d more, and %s uses %d of %d (an admin can raise it: eitri quota set --user %s --%s N)",
				quotaNames[i], *n, p.Name, *haves[i], *limits[i], p.Name, flagName(quotaNames[i]))
		}
	}
	return nil
}

func flagName(quota string) string {
	b := []byte(quota)
	for i, c := range b {
		if c == '_' {
			b[i] = '-'
		}
	}
	return string(b)
}

// OpenStream counts a streaming call (a watch, a console, a tunnel, an MCP
// event stream or vm_create wait) against the caller's quota; release
// gives it back when the stream ends. A request without a user principal
// (an agent's stream) is not counted.
func (f *Fleet) OpenStream(ctx context.Context) (release func(), err error) {
	p, ok := auth.FromContext(ctx)
	if !ok || p.UserID == "" {
		return func() {}, nil
	}
	eff, _, _, err := f.limits(ctx, f.st, p.UserID)
	if err != nil {
		return nil, err
	}
	q := &f.quota
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.streams == nil {
		q.streams = map[string]int64{}
	}
	if n := q.streams[p.UserID]; n >= eff.Streams {
		return nil, errorf(Exhausted, "quota: streams: %s already has %d of %d streams open (watches, consoles, tunnels, MCP event streams and vm_create waits); close one (an admin can raise it: eitri quota set --user %s --streams N)",
			p.Name, n, eff.Streams, p.Name)
	}
	q.streams[p.UserID]++
	var once sync.Once
	return func() {
		once.Do(func() {
			q.mu.Lock()
			defer q.mu.Unlock()
			if q.streams[p.UserID]--; q.streams[p.UserID] <= 0 {
				delete(q.streams, p.UserID)
			}
		})
	}, nil
}

// quotaSubject resolves whose quota a request names: the caller's for "",
// another user's for an admin only.
func (f *Fleet) quotaSubject(ctx context.Context, p auth.Principal, userName string) (store.User, error) {
	if err := checkLen("user_name", userName, bounds.MaxNameLen); err != nil {
		return store.User{}, err
	}
	if userName == "" || userName == p.Name {
		if p.UserID == "" {
			return store.User{}, invalid("user_name", "required")
		}
		return store.User{ID: p.UserID, Name: p.Name}, nil
	}
	if !p.Admin {
		return store.User{}, errorf(Denied, "only an admin may read or set another user's quota")
	}
	u, err := f.st.UserByName(ctx, userName)
	if errors.Is(err, store.ErrNotFound) {
		return store.User{}, errorf(NotFound, "user_name: no user %q", userName)
	}
	return u, err
}

// GetQuota returns a user's limits and usage.
func (f *Fleet) GetQuota(ctx context.Context, userName string) (*eitriv1.Quota, error) {
	p, err := principal(ctx)
	if err != nil {
		return nil, err
	}
	u, err := f.quotaSubject(ctx, p, userName)
	if err != nil {
		return nil, err
	}
	return f.quotaView(ctx, u)
}

func (f *Fleet) quotaView(ctx context.Context, u store.User) (*eitriv1.Quota, error) {
	eff, own, defaults, err := f.limits(ctx, f.st, u.ID)
	if err != nil {
		return nil, err
	}
	use, err := f.usage(ctx, f.st, u.ID)
	if err != nil {
		return nil, err
	}
	return &eitriv1.Quota{
		UserId: u.ID, UserName: u.Name,
		Effective: usageLimits(eff), Own: limitsView(own), Defaults: f.defaultsView(defaults),
		Usage: &eitriv1.QuotaUsage{Vms: use.VMs, Vcpus: use.VCPUs, MemMb: use.MemMB, DiskGb: use.DiskGB, Exposures: use.Exposures, Streams: use.Streams},
	}, nil
}

// defaultsView is the defaults with the built-in value where none is set.
func (f *Fleet) defaultsView(d store.Limits) *eitriv1.QuotaLimits {
	eff := BuiltinQuota
	effs := eff.fields()
	for i, v := range limitFields(&d) {
		if *v != nil {
			*effs[i] = **v
		}
	}
	return usageLimits(eff)
}

func usageLimits(u Usage) *eitriv1.QuotaLimits {
	return &eitriv1.QuotaLimits{Vms: &u.VMs, Vcpus: &u.VCPUs, MemMb: &u.MemMB, DiskGb: &u.DiskGB, Exposures: &u.Exposures, Streams: &u.Streams}
}

func limitsView(l store.Limits) *eitriv1.QuotaLimits {
	return &eitriv1.QuotaLimits{Vms: l.VMs, Vcpus: l.VCPUs, MemMb: l.MemMB, DiskGb: l.DiskGB, Exposures: l.Exposures, Streams: l.Streams}
}

// quotaLimitsFields lists a request's limits in Usage order.
func quotaLimitsFields(l *eitriv1.QuotaLimits) []*int64 {
	if l == nil {
		return make([]*int64, len(quotaNames))
	}
	return []*int64{l.Vms, l.Vcpus, l.MemMb, l.DiskGb, l.Exposures, l.Streams}
}

// SetQuota changes a user's own limits or the defaults (admins only).
func (f *Fleet) SetQuota(ctx context.Context, r *eitriv1.SetQuotaRequest) (*eitriv1.SetQuotaResponse, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, err
	}
	set := quotaLimitsFields(r.GetLimits())
	for i, v := range set {
		if v != nil && *v < 0 {
			return nil, invalid("limits."+quotaNames[i], "must not be negative, got %d", *v)
		}
	}
	if len(r.GetUnset()) > len(quotaNames) {
		return nil, invalid("unset", "at most %d names", len(quotaNames))
	}
	reset := make([]bool, len(quotaNames))
	for _, name := range r.GetUnset() {
		i := slices.Index(quotaNames, name)
		if i < 0 {
			return nil, invalid("unset", "%.64q is not a limit (want one of %v)", name, quotaNames)
		}
		if set[i] != nil {
			return nil, invalid("unset", "%s is both set and unset", name)
		}
		reset[i] = true
	}
	change := func(l *store.Limits) {
		for i, v := range limitFields(l) {
			switch {
			case set[i] != nil:
				n := *set[i]
				*v = &n
			case reset[i]:
				*v = nil
			}
		}
	}
	if r.GetDefaults() {
		if r.GetUserName() != "" {
			return nil, invalid("user_name", "must be empty when setting the defaults")
		}
		d, err := f.st.UpdateQuotaDefaults(ctx, change)
		if err != nil {
			return nil, err
		}
		f.log.Info("quota defaults changed", "by", p.Name)
		return &eitriv1.SetQuotaResponse{Defaults: f.defaultsView(d)}, nil
	}
	u, err := f.quotaSubject(ctx, p, r.GetUserName())
	if err != nil {
		return nil, err
	}
	if _, err := f.st.UpdateUserQuota(ctx, u.ID, change); err != nil {
		return nil, storeErr(err, "user "+u.Name)
	}
	f.log.Info("quota changed", "user", u.Name, "by", p.Name)
	q, err := f.quotaView(ctx, u)
	if err != nil {
		return nil, err
	}
	return &eitriv1.SetQuotaResponse{Defaults: q.Defaults, Quota: q}, nil
}
