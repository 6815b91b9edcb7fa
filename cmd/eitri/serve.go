package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/a73x/eitri/agent"
	"github.com/a73x/eitri/agent/imagecache"
	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/frontend"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/fleet"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/addrpolicy"
)

// cpFlags are the control plane's flags, which eitri server and eitri dev
// share: registered once, so the two cannot drift apart in name or meaning.
type cpFlags struct {
	listen, dataDir string
	grace           time.Duration
	// stuckAfter: how long a connected host may sit on its old version
	// after an upgrade offer before it shows stuck.
	stuckAfter time.Duration
	ports      portRange
	level      string
}

// cpDefaults is where eitri server and eitri dev differ.
type cpDefaults struct {
	listen, listenUsage   string
	dataDir, dataDirUsage string
	grace                 time.Duration
}

func (c *cpFlags) register(fs *pflag.FlagSet, d cpDefaults) {
	fs.StringVar(&c.listen, "listen", d.listen, d.listenUsage)
	fs.StringVar(&c.dataDir, "data-dir", d.dataDir, d.dataDirUsage)
	fs.DurationVar(&c.grace, "delete-grace", d.grace, "how long a deleted VM stays restorable")
	c.stuckAfter = fleet.DefaultStuckAfter
	fs.Var((*positiveDuration)(&c.stuckAfter), "upgrade-stuck-after", "how long a connected host may stay on its old agent version after an upgrade offer before it shows stuck")
	fs.Var(&c.ports, "port-range", "host ports allocated to exposures that name none (default 30000-32767)")
	fs.StringVar(&c.level, "log-level", "info", "debug, info, warn or error")
}

// serverFlags are eitri server's flags.
type serverFlags struct {
	cpFlags
	db                        string
	publicURL, advertiseURL   string
	tlsCert, tlsKey, tlsHosts string
	releaseKey                releaseKeyFlag
	// imageAllow admits these prefixes to the image catalogue's fetches
	// beyond the public internet, as the agent's flag of the same name
	// does for image downloads.
	imageAllow prefixList
}

func newServerCmd() *cobra.Command {
	var f serverFlags
	cmd := &cobra.Command{
		Use:   "server",
		Short: "Run the control plane",
		Args:  cli.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return runServer(cmd.Context(), f) },
	}
	fs := cmd.Flags()
	f.cpFlags.register(fs, cpDefaults{
		listen: "0.0.0.0:7443", listenUsage: "address to serve the API, agents and console on",
		dataDir: "/var/lib/eitri", dataDirUsage: "where the database, TLS material and admin token live",
		grace: 24 * time.Hour,
	})
	// The default is read at run time, not shown here: --help would print
	// a password kept in EITRI_DB.
	fs.StringVar(&f.db, "db", "", "PostgreSQL that replicas share, as postgres://USER@HOST/DB?sslmode=verify-full (default $EITRI_DB, else SQLite in --data-dir); keep a password in EITRI_DB, PGPASSWORD or ~/.pgpass, not on the command line")
	fs.StringVar(&f.publicURL, "public-url", "", "URL agents dial, or every replica's and the load balancer's, comma-separated (default https://<hostname>:<port>)")
	fs.StringVar(&f.advertiseURL, "advertise-url", "", "with --db: this replica's own URL as agents reach it, where a host another replica holds answers this one's consoles and tunnels (default https://<hostname>:<port>)")
	fs.StringVar(&f.tlsCert, "tls-cert", "", "serving certificate (PEM); default: a self-made CA and certificate")
	fs.StringVar(&f.tlsKey, "tls-key", "", "key for --tls-cert")
	fs.StringVar(&f.tlsHosts, "tls-hosts", "", "extra comma-separated names/IPs for the self-made certificate")
	fs.Var(&f.releaseKey, "release-key", "release public key (or a .pub file, from eitri release keygen) that agent builds must be signed with; join tokens carry it to new agents")
	fs.Var(&f.imageAllow, "image-allow", "CIDR,... the image catalogue's fetches (SUMS files, signatures, the image it hashes) may also reach; by default only public addresses")
	cmd.AddCommand(newMigrateDBCmd())
	return cmd
}

func runServer(ctx context.Context, f serverFlags) error {
	log := newLogger(f.level)
	db := f.db
	if db == "" {
		db = os.Getenv("EITRI_DB")
	}
	if db != "" && !store.IsPostgres(db) {
		// Not echoed: a mistyped URL may still hold a password.
		return errors.New("--db / EITRI_DB: want a postgres:// or postgresql:// URL (SQLite needs no flag: it lives in --data-dir)")
	}
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return err
	}
	hn, _ := os.Hostname()
	own := "https://" + net.JoinHostPort(hn, portOf(ln.Addr()))
	pub := f.publicURL
	if pub == "" {
		pub = own
	}
	advertise := f.advertiseURL
	if advertise == "" && db != "" {
		advertise = own
	}
	var hosts []string
	if f.tlsHosts != "" {
		hosts = strings.Split(f.tlsHosts, ",")
	}
	srv, err := server.New(ctx, server.Config{
		DataDir: f.dataDir, DB: db, PublicURL: pub, AdvertiseURL: advertise, TLSCert: f.tlsCert, TLSKey: f.tlsKey, TLSHosts: hosts,
		DeleteGrace: f.grace, PortMin: f.ports.min, PortMax: f.ports.max, Console: consoleHandler(), Log: log,
		ReleaseKey: f.releaseKey.key, Version: version, StuckAfter: f.stuckAfter,
		ImagePolicy: addrpolicy.Policy{Allow: f.imageAllow, Hint: "an operator can allow it with eitri server --image-allow"},
	})
	if err != nil {
		return err
	}
	defer srv.Close()
	announce(srv, f.dataDir, pub)
	log.Info("control plane listening", "addr", ln.Addr().String(), "url", pub, "fingerprint", srv.Fingerprint)
	return srv.Serve(ctx, ln)
}

// announce says where the first admin's token is. The token itself goes to
// the file only (mode 0600): stderr ends up in journals and CI logs that
// other people read.
func announce(srv *server.Server, dataDir, url string) {
	if srv.AdminToken == "" {
		return
	}
	path := filepath.Join(dataDir, "admin.token")
	fmt.Fprintf(os.Stderr, "\nFirst start: created the admin user. Its token is in %s (readable by this user only):\n\n  export EITRI_URL=%s\n  export EITRI_TOKEN=$(cat %s)\n\n",
		path, url, cli.ShellQuote(path))
}

func portOf(a net.Addr) string {
	_, p, _ := net.SplitHostPort(a.String())
	return p
}

// devFlags are eitri dev's flags: its own and the agent's.
type devFlags struct {
	cpFlags
	guestImage string
	agent      agentFlags
}

func newDevCmd() *cobra.Command {
	var f devFlags
	cmd := &cobra.Command{
		Use:   "dev",
		Short: "Run the control plane and a local agent in one process (h2c on loopback)",
		Args:  cli.NoArgs,
		RunE:  func(cmd *cobra.Command, _ []string) error { return runDev(cmd.Context(), f) },
	}
	fs := cmd.Flags()
	f.cpFlags.register(fs, cpDefaults{
		listen: "127.0.0.1:8080", listenUsage: "loopback address (plain h2c, so curl works)",
		dataDir: ".data/dev", dataDirUsage: "state for the control plane and the local agent",
		grace: 10 * time.Minute,
	})
	fs.StringVar(&f.guestImage, "guest-image", "", "directory holding the built test guest (eitri-guest.qcow2/.raw), served for the quickstart")
	f.agent.register(fs)
	return cmd
}

func runDev(ctx context.Context, f devFlags) error {
	ac := f.agent
	log := newLogger(f.level)
	addr, err := loopbackAddr(ctx, f.listen, lookupHost)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", addr.String())
	if err != nil {
		return err
	}
	url := "http://" + ln.Addr().String()
	cpDir := filepath.Join(f.dataDir, "control")
	// Dev mode signs its own builds: the control plane takes them and the
	// local agent trusts them, with no key handling by hand.
	releaseKey, err := devReleaseKey(cpDir)
	if err != nil {
		return fmt.Errorf("dev release key: %w", err)
	}
	if ac.releaseKey.key.IsZero() {
		ac.releaseKey.key = releaseKey
	}
	srv, err := server.New(ctx, server.Config{
		ReleaseKey: releaseKey, Version: version, StuckAfter: f.stuckAfter,
		DataDir: cpDir, PublicURL: url, Plaintext: true, DeleteGrace: f.grace, PortMin: f.ports.min, PortMax: f.ports.max,
		Console: consoleHandler(), Log: log.With("part", "control"),
		Routes: func(r chi.Router) { serveGuestImage(r, f.guestImage, url) },
		// One --image-allow for both halves: they are one machine.
		ImagePolicy: addrpolicy.Policy{Allow: ac.imageAllow, Hint: "an operator can allow it with --image-allow"},
	})
	if err != nil {
		return err
	}
	defer srv.Close()
	announce(srv, cpDir, url)
	if err := listTestGuest(ctx, srv.Fleet, f.guestImage, url); err != nil {
		log.Warn("the test guest is not in the catalogue", "err", err)
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(ctx, ln) }()

	// The local agent enrolls itself with a token minted in-process, so dev
	// mode needs no copy and paste.
	ac.cfg.DataDir = filepath.Join(f.dataDir, "agent")
	if f.guestImage != "" {
		ac.imageEndpoints = guestImageEndpoints(ln.Addr())
	}
	ac.cfg.MintJoinToken = func(ctx context.Context) (string, error) {
		admin := auth.WithPrincipal(ctx, auth.Principal{Name: "dev", Admin: true})
		r, err := srv.Fleet.CreateJoinToken(admin, 10*time.Minute)
		if err != nil {
			return "", err
		}
		return r.Token, nil
	}
	go func() {
		cfg, err := ac.config(log.With("part", "agent"))
		if err != nil {
			errc <- err
			return
		}
		errc <- agent.Run(ctx, cfg)
	}()
	log.Info("eitri dev is up", "url", url, "console", url+"/")
	// Both halves must have stopped before this returns: the agent holds its
	// data dir's lock and the control plane its database until they do, and
	// a dev restarted in the same process would find both still taken.
	var first error
	pending := 2
	select {
	case <-ctx.Done():
	case first = <-errc:
		pending--
	}
	cancel()
	for ; pending > 0; pending-- {
		<-errc
	}
	return first
}

// loopbackAddr resolves a --listen value for eitri dev and refuses anything
// that is not loopback: dev mode serves plain HTTP and enrolls its own agent,
// so it must never be reachable from another machine. ":8080", "0.0.0.0" and
// "[::]" mean every interface; a name must resolve to loopback addresses
// only. The address returned is what to bind, so the name is not looked up
// a second time by Listen.
func loopbackAddr(ctx context.Context, listen string, lookup func(ctx context.Context, host string) ([]netip.Addr, error)) (netip.AddrPort, error) {
	refuse := func(why string) (netip.AddrPort, error) {
		return netip.AddrPort{}, fmt.Errorf("--listen %q: %s; eitri dev serves plain HTTP and only listens on loopback (127.0.0.1, ::1 or localhost); use eitri server elsewhere", listen, why)
	}
	host, portStr, err := net.SplitHostPort(listen)
	if err != nil {
		return refuse("want HOST:PORT")
	}
	port, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return refuse("bad port")
	}
	if host == "" {
		return refuse("no host means every interface")
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		if !ip.Unmap().IsLoopback() {
			return refuse(ip.String() + " is not a loopback address")
		}
		return netip.AddrPortFrom(ip.Unmap(), uint16(port)), nil
	}
	ips, err := lookup(ctx, host)
	if err != nil || len(ips) == 0 {
		return refuse("cannot resolve the name")
	}
	for _, ip := range ips {
		if !ip.Unmap().IsLoopback() {
			return refuse(host + " resolves to " + ip.String() + ", which is not loopback")
		}
	}
	return netip.AddrPortFrom(ips[0].Unmap(), uint16(port)), nil
}

func lookupHost(ctx context.Context, host string) ([]netip.Addr, error) {
	return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
}

// serveGuestImage serves the project's test guest so the quickstart can
// create a VM with no internet, and says where it is in /guest-image.json
// (the console offers it as a preset).
func serveGuestImage(r chi.Router, dir, base string) {
	r.Get("/guest-image.json", func(w http.ResponseWriter, _ *http.Request) {
		name, sum, err := guestImage(dir)
		if err != nil {
			http.Error(w, err.Error(), http.StatusNotFound)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string]string{"url": base + "/guest-image/" + name, "sha256": sum})
	})
	if dir == "" {
		return
	}
	r.Handle("/guest-image/*", http.StripPrefix("/guest-image/", http.FileServer(http.Dir(dir))))
}

// TestGuestImage is the catalogue name eitri dev lists its test guest
// under, so the quickstart creates by name.
const TestGuestImage = "test-guest"

// listTestGuest puts the served test guest in the catalogue as
// TestGuestImage, at the digest built beside it. Its guest init phones
// home like cloud-init, so that is its readiness.
func listTestGuest(ctx context.Context, f *fleet.Fleet, dir, base string) error {
	if dir == "" {
		return nil
	}
	name, sum, err := guestImage(dir)
	if err != nil {
		return err
	}
	u := base + "/guest-image/" + name
	return f.PutImage(ctx, TestGuestImage, u, sum, &eitriv1.ImageProperties{
		Os: "busybox", Architecture: "amd64", MinMemMb: 128, MinDiskGb: 1,
		Description: "eitri's tiny test guest: a Debian kernel and a busybox initramfs; boots in seconds",
		Readiness:   eitriv1.ImageReadiness_IMAGE_READINESS_CLOUD_INIT,
	}, "eitri dev")
}

// guestImageEndpoints admits dev mode's own test guest to its agent's image
// downloads: this listener, /guest-image/ only. The rest of the port is the
// control plane's API, which image_url must not reach, and loopback is
// otherwise refused like everywhere else.
func guestImageEndpoints(a net.Addr) []imagecache.Endpoint {
	tcp, ok := a.(*net.TCPAddr)
	if !ok {
		return nil
	}
	ap := tcp.AddrPort()
	return []imagecache.Endpoint{{AddrPort: netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), PathPrefix: "/guest-image/"}}
}

// guestImage picks the compressed qcow2 when built (smaller to copy), else
// the raw disk, with the digest build.sh wrote beside it.
func guestImage(dir string) (name, sum string, err error) {
	if dir == "" {
		return "", "", errors.New("no test guest image in this build (make guest-image)")
	}
	for _, n := range []string{"eitri-guest.qcow2", "eitri-guest.raw"} {
		b, err := os.ReadFile(filepath.Join(dir, n+".sha256"))
		if err != nil {
			continue
		}
		if f := strings.Fields(string(b)); len(f) > 0 {
			return n, f[0], nil
		}
	}
	return "", "", fmt.Errorf("no built guest image in %s", dir)
}

// consoleHandler is the embedded console, or nil (the server then says how
// to build it).
func consoleHandler() http.Handler { return frontend.Handler() }

// positiveDuration is a duration flag that refuses zero and less, where
// neither means anything (how often, how long before).
type positiveDuration time.Duration

func (d *positiveDuration) String() string { return time.Duration(*d).String() }

func (d *positiveDuration) Type() string { return "duration" }

func (d *positiveDuration) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		return err
	}
	if v <= 0 {
		return fmt.Errorf("want a positive duration, got %s", v)
	}
	*d = positiveDuration(v)
	return nil
}

// portRange is a "LOW-HIGH" flag.
type portRange struct{ min, max uint16 }

func (p *portRange) String() string {
	if p.min == 0 {
		return ""
	}
	return fmt.Sprintf("%d-%d", p.min, p.max)
}

func (p *portRange) Type() string { return "LOW-HIGH" }

func (p *portRange) Set(s string) error {
	lo, hi, ok := strings.Cut(s, "-")
	a, err1 := strconv.ParseUint(lo, 10, 16)
	b, err2 := strconv.ParseUint(hi, 10, 16)
	if !ok || err1 != nil || err2 != nil || a == 0 || a > b {
		return fmt.Errorf("want LOW-HIGH with 1 <= LOW <= HIGH <= 65535, got %q", s)
	}
	p.min, p.max = uint16(a), uint16(b)
	return nil
}
