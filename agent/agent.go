// Package agent is the host agent process: Run wires the host's building
// blocks (network, hypervisor, image cache, reconcile engine, published
// ports) to the control plane and keeps them running until its context
// ends, as server.New is the control plane. The process's lifecycle —
// start, enrolment, shutdown — lives here; cmd/eitri only turns flags into
// a Config.
package agent

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"connectrpc.com/connect"

	"github.com/a73x/eitri/agent/consolerelay"
	"github.com/a73x/eitri/agent/exposeproxy"
	"github.com/a73x/eitri/agent/hostvm"
	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/node"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/reconcile"
	"github.com/a73x/eitri/agent/state"
	"github.com/a73x/eitri/agent/syncclient"
	"github.com/a73x/eitri/agent/upgrade"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
	"github.com/a73x/eitri/wire/release"
)

// Config is how the agent is started. Defaults gives every field a real
// agent starts with; a zero field is not filled in.
type Config struct {
	// DataDir holds the agent's state, image cache and VM disks; one agent
	// at a time may use it.
	DataDir string
	// Version is this build's, said to the control plane at enrolment and
	// on every connection.
	Version string
	// Name is this host's name in the fleet.
	Name string
	// Address is what published ports are reachable on; "" is the source
	// address of the default route.
	Address string
	// JoinToken enrolls a host that has no identity yet; an enrolled host
	// ignores it (with a warning).
	JoinToken string
	// MintJoinToken makes a join token in-process when JoinToken is empty
	// (eitri dev enrolls its own agent); nil for a real agent.
	MintJoinToken func(context.Context) (string, error)

	// Bridge is the bridge the guests attach to; Subnet its address and
	// the guests' subnet (NAT to the outside).
	Bridge string
	Subnet netip.Prefix
	// DNSUpstreams replace the host's resolv.conf as the guests' resolvers.
	DNSUpstreams []netip.AddrPort
	// Accel is the guest accelerator to use.
	Accel qemu.AccelMode

	// VMTimeout bounds one create or converge pass (image download
	// included).
	VMTimeout time.Duration
	// SSHFallbackAfter is how long a guest has to phone home before an
	// answering sshd makes it ready instead.
	SSHFallbackAfter time.Duration
	// MaxCreates is how many creates run at once.
	MaxCreates int
	// CreateAttempts and RetryBackoff: a create's budget, and the wait
	// after its first failed attempt (doubling after each).
	CreateAttempts int
	RetryBackoff   time.Duration

	// CacheBytes caps the image cache.
	CacheBytes int64
	// ImagePolicy is what image downloads may connect to.
	ImagePolicy imagecache.AddressPolicy

	// ReleaseKey is the key this host's upgrades must be signed with; zero
	// takes the one the join token carried at enrollment.
	ReleaseKey release.PublicKey
	// Exe is the binary an upgrade replaces; "" is the running one.
	Exe string
	// UpgradeHealthBound is how long a new build has to reconnect before
	// the host rolls it back (default upgrade.DefaultHealthBound).
	UpgradeHealthBound time.Duration
	// UsageEvery is how often the guests and the host are measured and the
	// sample sent to the control plane.
	UsageEvery time.Duration

	Log *slog.Logger
}

// Defaults is the Config a real agent starts from; the caller fills in the
// data dir, name, version and join token.
func Defaults() Config {
	return Config{
		Bridge:           netsetup.DefaultBridge,
		Subnet:           netip.MustParsePrefix("10.77.0.1/24"),
		Accel:            qemu.AccelAuto,
		VMTimeout:        15 * time.Minute,
		SSHFallbackAfter: hostvm.DefaultSSHFallbackAfter,
		MaxCreates:       2,
		CreateAttempts:   5,
		RetryBackoff:     20 * time.Second,
		CacheBytes:       50 << 30,
		UsageEvery:       10 * time.Second,
	}
}

// Run is the agent: it refuses a host that cannot run VMs, enrolls it if it
// has to, brings the host's network, hypervisor and published ports back,
// and keeps the stream to the control plane up until ctx ends. It ends with
// an *upgrade.Restart once a new build of itself is in place: the caller
// then hands the process over (upgrade.Exec), after everything here is
// closed.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Log
	if log == nil {
		log = slog.Default()
	}
	if missing := append(qemu.Requirements(), netsetup.Requirements()...); len(missing) > 0 {
		return fmt.Errorf("this host cannot run VMs yet:\n  %s", strings.Join(missing, "\n  "))
	}
	lock, err := state.LockDir(cfg.DataDir)
	if err != nil {
		return err
	}
	defer lock.Release()
	st, err := state.Open(filepath.Join(cfg.DataDir, "state"))
	if err != nil {
		return err
	}
	id, err := identity(ctx, st, cfg, log)
	if err != nil {
		return err
	}
	network, err := netsetup.Setup(ctx, netsetup.Config{
		Bridge: cfg.Bridge, Prefix: cfg.Subnet, LeaseFile: filepath.Join(cfg.DataDir, "leases.json"), DNSUpstreams: cfg.DNSUpstreams, Log: log,
		// Guests fetch their renewed host certificates from the record
		// the engine keeps them in.
		HostCerts: func(vmID string) string {
			rec, ok, err := st.LoadVM(vmID)
			if err != nil || !ok {
				return ""
			}
			return rec.HostCert
		},
	})
	if err != nil {
		return fmt.Errorf("host network: %w", err)
	}
	defer network.Close()
	qb, err := qemu.New(qemu.Config{Dir: filepath.Join(cfg.DataDir, "vms"), Accel: cfg.Accel, Log: log,
		OnAccelChange: accelChangeLogger(log)})
	if err != nil {
		return err
	}
	// Prove the accelerator before taking on any VM. A host where nothing
	// works still connects, so the fleet can see why it runs no guests.
	if acc, err := qb.Probe(ctx); err != nil {
		log.Error("no usable guest accelerator", "err", err)
	} else {
		log.Info("guest accelerator", "accelerator", acc.Name, "cpu", acc.CPU, "why", acc.Reason)
	}
	logImagePolicy(log, cfg.ImagePolicy)
	cache := imagecache.New(filepath.Join(cfg.DataDir, "images"), imagecache.WithMaxBytes(cfg.CacheBytes),
		imagecache.WithDialPolicy(cfg.ImagePolicy), imagecache.WithLogger(log))
	images := hostvm.NewImages(cache)
	cached := CacheReport{Cache: cache, State: st, Log: log}
	hv, err := hostvm.New(hostvm.Config{QEMU: qb, Net: network, St: st, Images: images, SSHFallbackAfter: cfg.SSHFallbackAfter, Log: log})
	if err != nil {
		return err
	}
	// One connection carries the Sync stream, the calls (consoles, tunnels,
	// which reach a guest at the address its published ports do) and the
	// host-key signing.
	hc := syncclient.HTTPClient(id)
	capacity := hostCapacity(cfg.DataDir)
	eng, err := reconcile.New(reconcile.Config{
		Hyper: hv, Images: images.Resolve, ImageCached: cache.Holds, Seed: hv.WriteSeed, St: st,
		VMTimeout: cfg.VMTimeout, MaxConcurrentCreates: cfg.MaxCreates, Log: log,
		MaxCreateAttempts: cfg.CreateAttempts, RetryBackoff: cfg.RetryBackoff,
		// Guests' host keys are certified before their seed is written.
		SignHostKey: hostKeySigner(hc, id),
		// The admission check measures what the host reports as capacity.
		Capacity: capacity.resources,
	})
	if err != nil {
		return err
	}
	defer eng.Close()

	var n *node.Node
	proxy := exposeproxy.New(exposeproxy.Config{Log: log, Resolve: func(vmID string) (netip.Addr, bool) { return n.Resolve(vmID) }})
	defer proxy.Close()
	n = node.New(node.Config{
		Engine: eng, Ports: proxy, Log: log, Records: st,
		// Before the engine has a row for a VM (no snapshot since start),
		// its published port reaches the guest on the host's own word:
		// its QEMU is running (adopted, network back in place) and leased.
		GuestAddr: func(vmID string) (netip.Addr, bool) {
			ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			if running, err := hv.Power(ctx, vmID); err != nil || !running {
				return netip.Addr{}, false
			}
			return hv.Address(ctx, vmID)
		},
		Capacity: capacity.report,
		Metrics:  node.HostMetrics(cfg.DataDir),
		Accelerator: func() (string, string) {
			acc := qb.Accel()
			return acc.Name, acc.Reason
		},
	})
	go n.Run(ctx)
	// Published ports come back now, not when the control plane answers:
	// it may be down for a while.
	if err := n.Restore(); err != nil {
		log.Error("cannot restore the published ports; they come back with the next snapshot", "err", err)
	}

	addr := cfg.Address
	if addr == "" {
		addr = defaultAddress()
	}
	up, err := newUpgrader(cfg, id, hc, log)
	if err != nil {
		return err
	}
	// The upgrader ends the stream (and with it Run) once a new build is
	// in place; everything deferred here closes before the process is
	// handed over.
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	go func() {
		if err := up.Run(ctx); err != nil {
			stop(err)
		}
	}()
	instance := rand.Text()
	log.Info("agent starting", "host", id.HostID, "control_plane", id.ServerURL, "accelerator", qb.Accel().Name, "address", addr)
	go func() {
		_ = consolerelay.Run(ctx, consolerelay.Config{Client: hc, Identity: id, InstanceID: instance, Serial: qb, Guests: n.Resolve,
			PruneImages: cached.Prune, Log: log})
	}()
	err = syncclient.Run(ctx, syncclient.Config{
		Identity: id, Source: upgrading{n, up}, Log: log, Client: hc,
		Hello: func() *eitriv1.Hello {
			acc := qb.Accel()
			cp, epoch, gen := eng.Lineage()
			return &eitriv1.Hello{HostId: id.HostID, AgentVersion: cfg.Version, Hostname: cfg.Name, Address: addr, InstanceId: instance,
				Accelerator: acc.Name, AcceleratorReason: acc.Reason,
				ControlPlaneId: cp, AppliedEpoch: epoch, AppliedGeneration: gen,
				Os: runtime.GOOS, Arch: runtime.GOARCH}
		},
		Usage:      usageSampler(cfg.DataDir, eng, qb),
		UsageEvery: cfg.UsageEvery,
		ImageCache: cached.Report, ImageCacheChanged: cached.Changed(ctx),
		// A snapshot applied is the control plane hearing this build: a
		// new build on trial has proved itself.
		OnSnapshot: func(uint64) { up.Healthy() },
	})
	var restart *upgrade.Restart
	if errors.As(context.Cause(ctx), &restart) {
		return restart
	}
	return err
}

// newUpgrader is the host's own upgrades: checked against the key the
// operator gave, else the one the host enrolled with.
func newUpgrader(cfg Config, id state.Identity, hc *http.Client, log *slog.Logger) (*upgrade.Upgrader, error) {
	key := cfg.ReleaseKey
	if key.IsZero() && id.ReleaseKey != "" {
		k, err := release.ParsePublicKey(id.ReleaseKey)
		if err != nil {
			return nil, fmt.Errorf("the release key saved at enrollment: %w", err)
		}
		key = k
	}
	if key.IsZero() {
		log.Warn("this host trusts no release key; it will refuse every upgrade (give one with --release-key)")
	}
	exe := cfg.Exe
	if exe == "" {
		var err error
		if exe, err = os.Executable(); err != nil {
			return nil, fmt.Errorf("find the agent's own binary: %w", err)
		}
	}
	return upgrade.New(upgrade.Config{
		Dir: filepath.Join(cfg.DataDir, "upgrade"), Exe: exe, Version: cfg.Version, Key: key,
		Client: hc, BaseURL: func() string { return id.ServerURL }, Credential: id.Credential,
		HealthBound: cfg.UpgradeHealthBound, Log: log,
	})
}

// upgrading is the node with the agent's own upgrade: an applied snapshot's
// offer goes to the upgrader, and every report says how the upgrade goes.
type upgrading struct {
	*node.Node
	up *upgrade.Upgrader
}

func (u upgrading) Apply(snap *eitriv1.DesiredStateSnapshot) bool {
	if !u.Node.Apply(snap) {
		return false // a snapshot the host refuses offers nothing either
	}
	u.up.Offer(snap.GetAgentUpgrade())
	return true
}

func (u upgrading) Fill(rep *eitriv1.ActualStateReport) {
	u.Node.Fill(rep)
	rep.Upgrade = u.up.Status()
}

// logImagePolicy says at start what image downloads may reach beyond the
// public internet.
func logImagePolicy(log *slog.Logger, p imagecache.AddressPolicy) {
	allow := make([]string, len(p.Allow))
	for i, a := range p.Allow {
		allow[i] = a.String()
	}
	own := make([]string, len(p.Endpoints))
	for i, e := range p.Endpoints {
		own[i] = e.AddrPort.String() + e.PathPrefix
	}
	log.Info("image downloads reach public addresses", "image_allow", strings.Join(allow, ","), "own", own)
}

// hostCapacity measures what the host offers guests in its data dir. The
// admission check and the report read the one measure, so a create is
// admitted against the figures the control plane placed it by.
type hostCapacity string

func (dataDir hostCapacity) resources() (reconcile.Resources, error) {
	vcpus, mem, disk, err := hostvm.Capacity(string(dataDir))
	return reconcile.Resources{VCPUs: int64(vcpus), MemMB: mem, DiskGB: disk}, err
}

// report is the measure as the control plane reads it; nil when it cannot
// be measured, rather than zero.
func (dataDir hostCapacity) report() *eitriv1.Capacity {
	r, err := dataDir.resources()
	if err != nil {
		return nil
	}
	return &eitriv1.Capacity{Vcpus: int32(r.VCPUs), MemMb: r.MemMB, DiskGb: r.DiskGB}
}

// hostKeySigner asks the control plane to certify a guest's host key, with
// the host's credential.
func hostKeySigner(hc *http.Client, id state.Identity) reconcile.HostKeySigner {
	client := eitriv1connect.NewAgentServiceClient(hc, id.ServerURL, connect.WithInterceptors(connclient.Bearer(id.Credential)))
	return func(ctx context.Context, vmID, pub string) (string, error) {
		resp, err := client.SignHostKey(ctx, connect.NewRequest(&eitriv1.SignHostKeyRequest{VmId: vmID, PublicKey: pub}))
		if err != nil {
			return "", err
		}
		return resp.Msg.GetCertificate(), nil
	}
}

// accelChangeLogger warns when a re-probe changes the accelerator. The
// first choice is not a change; the start-up probe logs it.
func accelChangeLogger(log *slog.Logger) func(qemu.Accel) {
	first := true
	return func(acc qemu.Accel) {
		if first {
			first = false
			return
		}
		log.Warn("guest accelerator changed", "accelerator", acc.Name, "cpu", acc.CPU, "why", acc.Reason)
	}
}

// defaultAddress is the source address of the default route: what other
// machines on the LAN most likely reach this host on. Connecting a UDP
// socket only asks the kernel for a route; nothing is sent.
func defaultAddress() string {
	c, err := net.Dial("udp4", "192.0.2.1:9")
	if err != nil {
		return "127.0.0.1"
	}
	defer c.Close()
	return c.LocalAddr().(*net.UDPAddr).IP.String()
}
