package main

import (
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/a73x/eitri/agent"
	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/upgrade"
	"github.com/a73x/eitri/cmd/eitri/cli"
)

// agentFlags are eitri agent's flags, which eitri dev shares: the agent's
// Config, and what is parsed from text when the agent starts.
type agentFlags struct {
	cfg agent.Config
	// subnet and accel are parsed when the agent starts: a bad value stops
	// it (exit status 1) rather than being a usage error.
	subnet, accel string
	cacheGB       int64
	// imageAllow admits these prefixes to image downloads beyond the public
	// internet: an operator's own mirrors.
	imageAllow prefixList
	// imageEndpoints are image servers the process runs itself (dev mode's
	// test guest), admitted for their paths only.
	imageEndpoints []imagecache.Endpoint
	releaseKey     releaseKeyFlag
}

func (a *agentFlags) register(fs *pflag.FlagSet) {
	d := agent.Defaults()
	hn, _ := os.Hostname()
	c := &a.cfg
	fs.StringVar(&c.Name, "name", hn, "this host's name in the fleet")
	fs.StringVar(&c.Address, "address", "", "address published ports are reachable on (default: the address of the default route)")
	fs.StringVar(&c.Bridge, "bridge", d.Bridge, "bridge the guests attach to")
	fs.StringVar(&a.subnet, "subnet", d.Subnet.String(), "bridge address and guest subnet (NAT to the outside)")
	fs.Func("dns-upstream", "resolver (ADDR or ADDR:PORT) the guests' DNS forwarder relays to; repeatable (default: the host's /etc/resolv.conf)", func(s string) error {
		up, err := netsetup.ParseUpstream(s)
		c.DNSUpstreams = append(c.DNSUpstreams, up)
		return err
	})
	fs.DurationVar(&c.VMTimeout, "vm-timeout", d.VMTimeout, "bound on one create or converge pass (image download included)")
	fs.DurationVar(&c.SSHFallbackAfter, "ssh-fallback-after", d.SSHFallbackAfter, "how long after power-on a guest has to phone home (cloud-init) before an answering sshd counts as ready; raise it on slow (TCG) hosts")
	fs.IntVar(&c.MaxCreates, "max-creates", d.MaxCreates, "creates running at once on this host")
	fs.IntVar(&c.CreateAttempts, "create-attempts", d.CreateAttempts, "attempts a create gets before its VM is failed (a permanent error fails it at once)")
	fs.DurationVar(&c.RetryBackoff, "retry-backoff", d.RetryBackoff, "wait after a VM's first failed create attempt or second failed run in a row; doubles with each further failure, up to 5m, with jitter")
	fs.Int64Var(&a.cacheGB, "image-cache-gb", d.CacheBytes>>30, "image cache size cap in GiB")
	fs.StringVar(&a.accel, "accel", string(d.Accel), "guest accelerator: auto (prove KVM with a probe guest, else TCG), kvm or tcg")
	fs.Var(&a.releaseKey, "release-key", "release public key (or a .pub file) this host's own upgrades must be signed with (default: the one its join token carried)")
	fs.DurationVar(&c.UpgradeHealthBound, "upgrade-health-bound", upgrade.DefaultHealthBound, "how long a new agent build has to reconnect before the host rolls it back")
	c.UsageEvery = d.UsageEvery
	fs.Var((*positiveDuration)(&c.UsageEvery), "usage-every", "how often the guests' and the host's usage is measured and sent to the control plane")
	fs.Var(&a.imageAllow, "image-allow", "CIDR,... image downloads may also reach (your own mirrors); by default only public addresses, never loopback, private, link-local or the like")
}

// config is the agent's Config from the flags.
func (a *agentFlags) config(log *slog.Logger) (agent.Config, error) {
	c := a.cfg
	prefix, err := netip.ParsePrefix(a.subnet)
	if err != nil {
		return c, fmt.Errorf("--subnet: %w", err)
	}
	accel, err := qemu.ParseAccelMode(a.accel)
	if err != nil {
		return c, err
	}
	c.Subnet, c.Accel = prefix, accel
	c.CacheBytes = a.cacheGB << 30
	c.ImagePolicy = a.imagePolicy()
	c.Version = version
	c.Log = log
	if !a.releaseKey.key.IsZero() {
		c.ReleaseKey = a.releaseKey.key
	}
	return c, nil
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
		Args:  cli.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg, err := a.config(newLogger(level))
			if err != nil {
				return err
			}
			return agent.Run(cmd.Context(), cfg)
		},
	}
	fs := cmd.Flags()
	a.register(fs)
	fs.StringVar(&a.cfg.DataDir, "data-dir", "/var/lib/eitri-agent", "agent state, image cache and VM disks")
	fs.StringVar(&a.cfg.JoinToken, "join", "", "join token from 'eitri host join-token' (first start only)")
	fs.StringVar(&level, "log-level", "info", "debug, info, warn or error")
	return cmd
}
