package main

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
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

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
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/connclient"
)

type agentFlags struct {
	dataDir string
	join    string
	name    string
	address string
	bridge  string
	subnet  string
	// dnsUpstreams replace the host's resolv.conf as the guests' resolvers.
	dnsUpstreams []netip.AddrPort
	vmTimeout    time.Duration
	// sshFallbackAfter: how long a guest has to phone home before an
	// answering sshd makes it ready instead.
	sshFallbackAfter time.Duration
	maxCreates       int
	// createAttempts and retryBackoff: a create's budget, and the wait
	// after its first failed attempt (doubling after each).
	createAttempts int
	retryBackoff   time.Duration
	cacheGB        int64
	accel          string
	// imageAllow admits these prefixes to image downloads beyond the public
	// internet: an operator's own mirrors.
	imageAllow prefixList
	// imageEndpoints are image servers the process runs itself (dev mode's
	// test guest), admitted for their paths only.
	imageEndpoints []imagecache.Endpoint
	// joinToken mints a token in-process (dev mode); nil for a real agent.
	joinToken func(context.Context) (string, error)
}

func (a *agentFlags) register(fs *pflag.FlagSet) {
	hn, _ := os.Hostname()
	fs.StringVar(&a.name, "name", hn, "this host's name in the fleet")
	fs.StringVar(&a.address, "address", "", "address published ports are reachable on (default: the address of the default route)")
	fs.StringVar(&a.bridge, "bridge", netsetup.DefaultBridge, "bridge the guests attach to")
	fs.StringVar(&a.subnet, "subnet", "10.77.0.1/24", "bridge address and guest subnet (NAT to the outside)")
	fs.Func("dns-upstream", "resolver (ADDR or ADDR:PORT) the guests' DNS forwarder relays to; repeatable (default: the host's /etc/resolv.conf)", func(s string) error {
		up, err := netsetup.ParseUpstream(s)
		a.dnsUpstreams = append(a.dnsUpstreams, up)
		return err
	})
	fs.DurationVar(&a.vmTimeout, "vm-timeout", 15*time.Minute, "bound on one create or converge pass (image download included)")
	fs.DurationVar(&a.sshFallbackAfter, "ssh-fallback-after", hostvm.DefaultSSHFallbackAfter, "how long after power-on a guest has to phone home (cloud-init) before an answering sshd counts as ready; raise it on slow (TCG) hosts")
	fs.IntVar(&a.maxCreates, "max-creates", 2, "creates running at once on this host")
	fs.IntVar(&a.createAttempts, "create-attempts", 5, "attempts a create gets before its VM is failed (a permanent error fails it at once)")
	fs.DurationVar(&a.retryBackoff, "retry-backoff", 20*time.Second, "wait after a VM's first failed create attempt or second failed run in a row; doubles with each further failure, up to 5m, with jitter")
	fs.Int64Var(&a.cacheGB, "image-cache-gb", 50, "image cache size cap in GiB")
	fs.StringVar(&a.accel, "accel", "auto", "guest accelerator: auto (prove KVM with a probe guest, else TCG), kvm or tcg")
	fs.Var(&a.imageAllow, "image-allow", "CIDR,... image downloads may also reach (your own mirrors); by default only public addresses, never loopback, private, link-local or the like")
}

// imagePolicy is what image downloads may connect to: public addresses,
// plus what the operator allowed and the process serves itself.
func (a *agentFlags) imagePolicy() imagecache.AddressPolicy {
	return imagecache.AddressPolicy{
		Allow:     a.imageAllow,
		Endpoints: a.imageEndpoints,
		Hint:      "an operator can allow it with --image-allow",
	}
}

// prefixList is a flag of comma-separated CIDRs or bare addresses; it may
// be repeated.
type prefixList []netip.Prefix

func (l *prefixList) String() string {
	if l == nil {
		return ""
	}
	s := make([]string, len(*l))
	for i, p := range *l {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

func (l *prefixList) Type() string { return "CIDR,..." }

func (l *prefixList) Set(v string) error {
	for f := range strings.SplitSeq(v, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		if !strings.Contains(f, "/") {
			ip, err := netip.ParseAddr(f)
			if err != nil {
				return fmt.Errorf("%q: want a CIDR (10.0.0.0/8) or an address", f)
			}
			*l = append(*l, netip.PrefixFrom(ip.WithZone(""), ip.BitLen()))
			continue
		}
		p, err := netip.ParsePrefix(f)
		if err != nil {
			return fmt.Errorf("%q: want a CIDR (10.0.0.0/8) or an address", f)
		}
		*l = append(*l, p.Masked())
	}
	return nil
}

func newAgentCmd() *cobra.Command {
	var a agentFlags
	var level string
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the host agent (enroll once with --join TOKEN)",
		Args:  noArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return runAgent(cmd.Context(), a, newLogger(level)) },
	}
	fs := cmd.Flags()
	a.register(fs)
	fs.StringVar(&a.dataDir, "data-dir", "/var/lib/eitri-agent", "agent state, image cache and VM disks")
	fs.StringVar(&a.join, "join", "", "join token from 'eitri host join-token' (first start only)")
	fs.StringVar(&level, "log-level", "info", "debug, info, warn or error")
	return cmd
}

// runAgent wires the host's building blocks and keeps the stream up.
func runAgent(ctx context.Context, a agentFlags, log *slog.Logger) error {
	if missing := append(qemu.Requirements(), netsetup.Requirements()...); len(missing) > 0 {
		return fmt.Errorf("this host cannot run VMs yet:\n  %s", strings.Join(missing, "\n  "))
	}
	prefix, err := netip.ParsePrefix(a.subnet)
	if err != nil {
		return fmt.Errorf("--subnet: %w", err)
	}
	accelMode, err := qemu.ParseAccelMode(a.accel)
	if err != nil {
		return err
	}
	lock, err := state.LockDir(a.dataDir)
	if err != nil {
		return err
	}
	defer lock.Release()
	st, err := state.Open(filepath.Join(a.dataDir, "state"))
	if err != nil {
		return err
	}
	id, err := identity(ctx, st, a)
	if err != nil {
		return err
	}
	network, err := netsetup.Setup(ctx, netsetup.Config{
		Bridge: a.bridge, Prefix: prefix, LeaseFile: filepath.Join(a.dataDir, "leases.json"), DNSUpstreams: a.dnsUpstreams, Log: log,
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
	qb, err := qemu.New(qemu.Config{Dir: filepath.Join(a.dataDir, "vms"), Accel: accelMode, Log: log,
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
	policy := a.imagePolicy()
	own := make([]string, len(policy.Endpoints))
	for i, e := range policy.Endpoints {
		own[i] = e.AddrPort.String() + e.PathPrefix
	}
	log.Info("image downloads reach public addresses", "image_allow", a.imageAllow.String(), "own", own)
	cache := imagecache.New(filepath.Join(a.dataDir, "images"), imagecache.WithMaxBytes(a.cacheGB<<30),
		imagecache.WithDialPolicy(policy), imagecache.WithLogger(log))
	images := hostvm.NewImages(cache)
	hv, err := hostvm.New(hostvm.Config{QEMU: qb, Net: network, St: st, Images: images, SSHFallbackAfter: a.sshFallbackAfter, Log: log})
	if err != nil {
		return err
	}
	// One connection carries the Sync stream, the calls (consoles, tunnels,
	// which reach a guest at the address its published ports do) and the
	// host-key signing.
	hc := id.HTTPClient()
	eng, err := reconcile.New(reconcile.Config{
		Hyper: hv, Images: images.Resolve, Seed: hv.WriteSeed, St: st,
		VMTimeout: a.vmTimeout, MaxConcurrentCreates: a.maxCreates, Log: log,
		MaxCreateAttempts: a.createAttempts, RetryBackoff: a.retryBackoff,
		// Guests' host keys are certified before their seed is written.
		SignHostKey: hostKeySigner(hc, id),
		// The admission check measures what the host reports as capacity.
		Capacity: func() (reconcile.Resources, error) {
			vcpus, mem, disk, err := hostvm.Capacity(a.dataDir)
			return reconcile.Resources{VCPUs: int64(vcpus), MemMB: mem, DiskGB: disk}, err
		},
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
		Capacity: func() *eitriv1.Capacity {
			vcpus, mem, disk, err := hostvm.Capacity(a.dataDir)
			if err != nil {
				return nil // unmeasured is not reported, rather than zero
			}
			return &eitriv1.Capacity{Vcpus: vcpus, MemMb: mem, DiskGb: disk}
		},
		Metrics: node.HostMetrics(a.dataDir),
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

	addr := a.address
	if addr == "" {
		addr = defaultAddress()
	}
	instance := rand.Text()
	log.Info("agent starting", "host", id.HostID, "control_plane", id.ServerURL, "accelerator", qb.Accel().Name, "address", addr)
	go func() {
		_ = consolerelay.Run(ctx, consolerelay.Config{Client: hc, Identity: id, InstanceID: instance, Serial: qb, Guests: n.Resolve, Log: log})
	}()
	return syncclient.Run(ctx, syncclient.Config{
		Identity: id, Source: n, Log: log, Client: hc,
		Hello: func() *eitriv1.Hello {
			acc := qb.Accel()
			cp, epoch, gen := eng.Lineage()
			return &eitriv1.Hello{HostId: id.HostID, AgentVersion: version, Hostname: a.name, Address: addr, InstanceId: instance,
				Accelerator: acc.Name, AcceleratorReason: acc.Reason,
				ControlPlaneId: cp, AppliedEpoch: epoch, AppliedGeneration: gen}
		},
	})
}

// hostKeySigner asks the control plane to certify a guest's host key, with
// the host's credential.
func hostKeySigner(hc *http.Client, id syncclient.Identity) reconcile.HostKeySigner {
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

// identity loads this host's enrollment, or enrolls with the join token.
func identity(ctx context.Context, st *state.Store, a agentFlags) (syncclient.Identity, error) {
	saved, ok, err := st.LoadIdentity()
	if err != nil {
		return syncclient.Identity{}, err
	}
	if ok {
		if a.join != "" {
			slog.Warn("already enrolled; ignoring --join", "host", saved.HostID)
		}
		return syncclient.Identity{ServerURL: saved.ServerURL, ServerURLs: saved.ServerURLs, Fingerprint: saved.CertFingerprint, HostID: saved.HostID, Credential: saved.Credential}, nil
	}
	tok := a.join
	if tok == "" && a.joinToken != nil {
		if tok, err = a.joinToken(ctx); err != nil {
			return syncclient.Identity{}, err
		}
	}
	if tok == "" {
		return syncclient.Identity{}, errors.New("this host is not enrolled: run it once with --join <token> (eitri host join-token prints one)")
	}
	id, err := syncclient.Enroll(ctx, tok, a.name, version)
	if err != nil {
		return syncclient.Identity{}, err
	}
	if err := st.SaveIdentity(state.Identity{HostID: id.HostID, Credential: id.Credential, ServerURL: id.ServerURL, ServerURLs: id.ServerURLs, CertFingerprint: id.Fingerprint}); err != nil {
		return syncclient.Identity{}, err
	}
	return id, nil
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
