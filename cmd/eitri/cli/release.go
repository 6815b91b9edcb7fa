package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/release"
)

func newReleaseCmd(a *app) *cobra.Command {
	cmd := noun("release", "Sign agent builds and hand them to the control plane",
		newReleaseKeygenCmd(a), newReleaseSignCmd(a), newReleaseUploadCmd(a), newReleaseListCmd(a))
	a.addOutputFlag(cmd)
	return cmd
}

func newReleaseKeygenCmd(a *app) *cobra.Command {
	var dir string
	cmd := &cobra.Command{
		Use:   "keygen",
		Short: "Make a release key pair (keep release.key off the control plane)",
		Args:  NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			keyPath, pubPath := filepath.Join(dir, "release.key"), filepath.Join(dir, "release.pub")
			for _, p := range []string{keyPath, pubPath} {
				if _, err := os.Stat(p); err == nil {
					return fmt.Errorf("%s already exists; a new key would strand every agent that trusts the old one", p)
				}
			}
			pub, priv, err := release.GenerateKey()
			if err != nil {
				return err
			}
			if err := os.MkdirAll(dir, 0o700); err != nil {
				return err
			}
			if err := os.WriteFile(keyPath, release.MarshalPrivateKey(priv), 0o600); err != nil {
				return err
			}
			if err := os.WriteFile(pubPath, []byte(pub.String()+"\n"), 0o644); err != nil {
				return err
			}
			fmt.Fprintf(a.io.Out, "Private key: %s (sign builds with it; keep it off the control plane)\nPublic key:  %s\n\n  eitri server --release-key %s\n\nKey id: %s\n",
				keyPath, pubPath, ShellQuote(pubPath), pub.ID())
			return nil
		},
	}
	cmd.Flags().StringVar(&dir, "dir", ".", "where to write release.key and release.pub")
	return cmd
}

func newReleaseSignCmd(a *app) *cobra.Command {
	var keyPath, out, version, goos, goarch string
	cmd := &cobra.Command{
		Use:   "sign BINARY",
		Short: "Sign an agent build (writes BINARY.sig)",
		Args:  needArgs("the binary to sign"),
		RunE: func(cmd *cobra.Command, args []string) error {
			b, err := os.ReadFile(keyPath)
			if err != nil {
				return err
			}
			priv, err := release.ParsePrivateKey(b)
			if err != nil {
				return fmt.Errorf("%s: %w", keyPath, err)
			}
			build, err := release.Inspect(args[0])
			if err != nil && (version == "" || goos == "" || goarch == "") {
				return fmt.Errorf("%w (say what it is with --version, --os and --arch)", err)
			}
			if err != nil {
				d, err := release.SumFile(args[0])
				if err != nil {
					return err
				}
				build = release.Build{SHA256: d.SHA256, Size: d.Size}
			}
			if version != "" {
				build.Version = version
			}
			if goos != "" {
				build.OS = goos
			}
			if goarch != "" {
				build.Arch = goarch
			}
			if build.Version == "" {
				return Usagef("%s was not built with -X main.version=…; say its version with --version", args[0])
			}
			sig, err := release.Sign(priv, build)
			if err != nil {
				return err
			}
			if out == "" {
				out = args[0] + ".sig"
			}
			if err := os.WriteFile(out, sig.Marshal(), 0o644); err != nil {
				return err
			}
			fmt.Fprintf(a.io.Out, "Signed %s %s for %s (sha256 %s) with %s: %s\n", filepath.Base(args[0]), build.Version, build.Platform(), build.SHA256, sig.KeyID, out)
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&keyPath, "key", "release.key", "the release private key (eitri release keygen)")
	fs.StringVarP(&out, "signature", "s", "", "where to write the signature (default BINARY.sig)")
	fs.StringVar(&version, "version", "", "the build's version (default: the -X main.version it was linked with)")
	fs.StringVar(&goos, "os", "", "the build's GOOS (default: read from the binary)")
	fs.StringVar(&goarch, "arch", "", "the build's GOARCH (default: read from the binary)")
	return cmd
}

func newReleaseUploadCmd(a *app) *cobra.Command {
	var sigPath string
	cmd := &cobra.Command{
		Use:   "upload BINARY",
		Short: "Admins: hand a signed agent build to the control plane",
		Args:  needArgs("the binary to upload"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if sigPath == "" {
				sigPath = args[0] + ".sig"
			}
			sig, err := os.ReadFile(sigPath)
			if err != nil {
				return fmt.Errorf("the signature: %w (sign it with eitri release sign)", err)
			}
			f, err := os.Open(args[0])
			if err != nil {
				return err
			}
			defer f.Close()
			c, err := a.dial()
			if err != nil {
				return err
			}
			st := c.release.UploadRelease(cmd.Context())
			send := func(r *eitriv1.UploadReleaseRequest) error {
				if err := st.Send(r); err != nil {
					// The server's reason, when it refused.
					if _, rerr := st.CloseAndReceive(); rerr != nil {
						return apiError(rerr)
					}
					return err
				}
				return nil
			}
			if err := send(&eitriv1.UploadReleaseRequest{Part: &eitriv1.UploadReleaseRequest_Signature{Signature: sig}}); err != nil {
				return err
			}
			buf := make([]byte, 1<<20)
			for {
				n, rerr := f.Read(buf)
				if n > 0 {
					chunk := append([]byte(nil), buf[:n]...)
					if err := send(&eitriv1.UploadReleaseRequest{Part: &eitriv1.UploadReleaseRequest_Chunk{Chunk: chunk}}); err != nil {
						return err
					}
				}
				if rerr == io.EOF {
					break
				}
				if rerr != nil {
					return rerr
				}
			}
			resp, err := st.CloseAndReceive()
			if err != nil {
				return apiError(err)
			}
			return c.show(resp.Msg, func(w io.Writer) { releaseTable(w, resp.Msg.GetRelease()) })
		},
	}
	cmd.Flags().StringVar(&sigPath, "signature", "", "the signature file (default BINARY.sig)")
	return cmd
}

func newReleaseListCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the agent builds the control plane holds",
		Args:    NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.release.ListReleases(ctx, connect.NewRequest(&eitriv1.ListReleasesRequest{}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { releaseTable(w, r.Msg.GetReleases()...) })
		}),
	}
}

func releaseTable(w io.Writer, rs ...*eitriv1.Release) {
	fmt.Fprintln(w, "VERSION\tPLATFORM\tSIZE\tSHA256\tSIGNER\tUPLOADED")
	for _, r := range rs {
		fmt.Fprintf(w, "%s\t%s/%s\t%.1f MiB\t%s\t%s\t%s\n", r.GetVersion(), r.GetOs(), r.GetArch(), float64(r.GetSize())/(1<<20),
			r.GetSha256(), r.GetSigner(), whenPB(r.GetUploadedAt(), "—"))
	}
}

func newHostUpgradeCmd(a *app) *cobra.Command {
	var to string
	var all, downgrade bool
	var maxUnavailable uint32
	cmd := &cobra.Command{
		Use:   "upgrade --to VERSION (--all | HOST...)",
		Short: "Admins: upgrade hosts' agents, a canary first, then waves; status|pause|resume|abort",
		Args:  cobra.ArbitraryArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if to == "" {
				return Usagef("say the version to upgrade to with --to")
			}
			if all == (len(args) > 0) {
				return Usagef("name the hosts to upgrade, or --all")
			}
			c, err := a.dial()
			if err != nil {
				return err
			}
			req := &eitriv1.StartRolloutRequest{Version: to, All: all, MaxUnavailable: maxUnavailable, AllowDowngrade: downgrade}
			for _, h := range args {
				id, err := c.hostID(cmd.Context(), h)
				if err != nil {
					return err
				}
				req.HostIds = append(req.HostIds, id)
			}
			r, err := c.release.StartRollout(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { rolloutTable(w, r.Msg.GetRollout()) })
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&to, "to", "", "the version to upgrade to (eitri release ls)")
	fs.BoolVar(&all, "all", false, "every host")
	fs.Uint32Var(&maxUnavailable, "max-unavailable", 1, "hosts upgrading at once after the canary")
	fs.BoolVar(&downgrade, "allow-downgrade", false, "let hosts go to an older version")
	cmd.AddCommand(newRolloutVerbCmd(a, "status", "Show the newest rollout, or one by id", nil),
		newRolloutVerbCmd(a, "pause", "Start no more hosts; those upgrading finish", func(ctx context.Context, c *client, id string) (*eitriv1.Rollout, error) {
			r, err := c.release.PauseRollout(ctx, connect.NewRequest(&eitriv1.PauseRolloutRequest{Id: id}))
			return r.Msg.GetRollout(), err
		}),
		newRolloutVerbCmd(a, "resume", "Go on with a paused or halted rollout (a failed host is offered the build again)", func(ctx context.Context, c *client, id string) (*eitriv1.Rollout, error) {
			r, err := c.release.ResumeRollout(ctx, connect.NewRequest(&eitriv1.ResumeRolloutRequest{Id: id}))
			return r.Msg.GetRollout(), err
		}),
		newRolloutVerbCmd(a, "abort", "End the rollout; hosts not yet upgraded keep their version", func(ctx context.Context, c *client, id string) (*eitriv1.Rollout, error) {
			r, err := c.release.AbortRollout(ctx, connect.NewRequest(&eitriv1.AbortRolloutRequest{Id: id}))
			return r.Msg.GetRollout(), err
		}))
	return cmd
}

// newRolloutVerbCmd acts on the newest rollout (or the one named); a nil
// act only shows it.
func newRolloutVerbCmd(a *app, use, short string, act func(context.Context, *client, string) (*eitriv1.Rollout, error)) *cobra.Command {
	return &cobra.Command{
		Use:   use + " [ROLLOUT]",
		Short: short,
		Args:  optionalArgs(0, "a rollout id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			id := ""
			if len(args) > 0 {
				id = args[0]
			}
			ctx := cmd.Context()
			r, err := c.release.GetRollout(ctx, connect.NewRequest(&eitriv1.GetRolloutRequest{Id: id}))
			if err != nil {
				return apiError(err)
			}
			ro := r.Msg.GetRollout()
			if act != nil {
				if ro, err = act(ctx, c, ro.GetId()); err != nil {
					return apiError(err)
				}
			}
			return c.show(ro, func(w io.Writer) { rolloutTable(w, ro) })
		},
	}
}

// rolloutTable is a rollout and each host's part in it.
func rolloutTable(w io.Writer, ro *eitriv1.Rollout) {
	state := ro.GetState()
	if ro.GetReason() != "" {
		state += " (" + ro.GetReason() + ")"
	}
	fmt.Fprintf(w, "Rollout %s to %s: %s, at most %d at once\n\n", ro.GetId(), ro.GetVersion(), state, ro.GetMaxUnavailable())
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	defer tw.Flush()
	fmt.Fprintln(tw, "HOST\tSTATE\tFROM\tSTARTED\tNOTES")
	for i, h := range ro.GetHosts() {
		notes := h.GetError()
		if i == 0 {
			notes = strings.TrimSuffix("canary; "+notes, "; ")
		}
		started := "—"
		if h.GetStartedAt() != nil {
			started = h.GetStartedAt().AsTime().Local().Format(time.TimeOnly)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", h.GetHostName(), h.GetState(), dash(h.GetFromVersion()), started, notes)
	}
}
