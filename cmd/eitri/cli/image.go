package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func newImageCmd(a *app) *cobra.Command {
	cmd := noun("image", "The catalogue of images VMs are created from by name",
		newImageAddCmd(a),
		newImageListCmd(a),
		newImageGetCmd(a),
		newImageRmCmd(a),
		newImageRefreshCmd(a),
		newImagePullCmd(a),
	)
	a.addOutputFlag(cmd)
	return cmd
}

// readinessWords are --readiness's words for ImageReadiness.
var readinessWords = map[string]eitriv1.ImageReadiness{
	"":           eitriv1.ImageReadiness_IMAGE_READINESS_UNSPECIFIED,
	"cloud-init": eitriv1.ImageReadiness_IMAGE_READINESS_CLOUD_INIT,
	"ssh":        eitriv1.ImageReadiness_IMAGE_READINESS_SSH,
	"address":    eitriv1.ImageReadiness_IMAGE_READINESS_ADDRESS,
}

func readinessWord(r eitriv1.ImageReadiness) string {
	for w, v := range readinessWords {
		if v == r && w != "" {
			return w
		}
	}
	return "default"
}

type imageAddFlags struct {
	url, sha, sums, sig, keyring, sumsName string
	readiness                              string
	props                                  eitriv1.ImageProperties
}

func newImageAddCmd(a *app) *cobra.Command {
	var f imageAddFlags
	cmd := &cobra.Command{
		Use:   "add NAME --url URL (--sha256 HEX | --sums URL [--sums-signature URL --keyring FILE])",
		Short: "Add an image to the catalogue (admins)",
		Long: `Add an image to the catalogue (admins). The digest is given (--sha256) or
read from the distribution's SHA256SUMS or SHA512SUMS (--sums), whose
detached OpenPGP signature (--sums-signature) is checked against the keys in
--keyring, pinned for this image. With --sums the control plane downloads the
image once and checks its bytes against the entry.`,
		Example: `  eitri image add debian-12 --url https://cloud.debian.org/images/cloud/bookworm/latest/debian-12-genericcloud-amd64.qcow2 \
    --sums https://cloud.debian.org/images/cloud/bookworm/latest/SHA512SUMS \
    --os debian --os-version 12 --arch amd64 --login-user debian --min-disk-gb 3 --readiness cloud-init
  eitri image add appliance --url https://example.org/a.raw --sha256 3f0c… --readiness address`,
		Args: needArgs("a NAME"),
		RunE: a.withClientArgs(func(ctx context.Context, c *client, args []string) error {
			how, ok := readinessWords[f.readiness]
			if !ok {
				return Usagef("--readiness: want cloud-init, ssh or address, got %q", f.readiness)
			}
			req := &eitriv1.AddImageRequest{Name: args[0], Url: f.url, Sha256: strings.ToLower(f.sha), SumsUrl: f.sums,
				SumsSignatureUrl: f.sig, SumsFileName: f.sumsName, Properties: &f.props}
			req.Properties.Readiness = how
			if f.keyring != "" {
				b, err := os.ReadFile(f.keyring)
				if err != nil {
					return Usagef("--keyring: %v", err)
				}
				req.Keyring = b
			}
			r, err := c.image.AddImage(ctx, connect.NewRequest(req))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { imageDetail(w, r.Msg.Image) })
		}),
	}
	fs := cmd.Flags()
	fs.StringVar(&f.url, "url", "", "image URL (http or https; raw, gzip raw or qcow2)")
	fs.StringVar(&f.sha, "sha256", "", "the image's sha256 (64 hex)")
	fs.StringVar(&f.sums, "sums", "", "URL of a SHA256SUMS or SHA512SUMS listing the image")
	fs.StringVar(&f.sig, "sums-signature", "", "URL of the SUMS file's detached OpenPGP signature (needs --keyring)")
	fs.StringVar(&f.keyring, "keyring", "", "file of OpenPGP public keys (armored or binary) the signature must be made by")
	fs.StringVar(&f.sumsName, "sums-name", "", "the name the SUMS file lists the image under (default: the URL's file name)")
	fs.StringVar(&f.props.Os, "os", "", "operating system, e.g. debian")
	fs.StringVar(&f.props.OsVersion, "os-version", "", "its version, e.g. 12")
	fs.StringVar(&f.props.Architecture, "arch", "", "architecture, e.g. amd64")
	fs.StringVar(&f.props.LoginUser, "login-user", "", "the user to log in as")
	fs.Int64Var(&f.props.MinDiskGb, "min-disk-gb", 0, "the smallest disk a VM of it may have, GiB")
	fs.Int64Var(&f.props.MinMemMb, "min-mem-mb", 0, "the least memory a VM of it may have, MiB")
	fs.StringVar(&f.props.Description, "description", "", "what it is, for people choosing it")
	fs.StringVar(&f.readiness, "readiness", "", "how a VM of it is judged ready: cloud-init, ssh or address (default: the host's)")
	return cmd
}

func newImageListCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the catalogue",
		Args:    NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.image.ListImages(ctx, connect.NewRequest(&eitriv1.ListImagesRequest{}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { imageTable(w, r.Msg.Images...) })
		}),
	}
}

func newImageGetCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "get NAME",
		Short: "Show an image, its versions and where each came from",
		Args:  needArgs("an image NAME"),
		RunE: a.withClientArgs(func(ctx context.Context, c *client, args []string) error {
			r, err := c.image.GetImage(ctx, connect.NewRequest(&eitriv1.GetImageRequest{Name: args[0]}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { imageDetail(w, r.Msg.Image) })
		}),
	}
}

func newImageRmCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "rm NAME",
		Aliases: []string{"delete"},
		Short:   "Remove an image from the catalogue (admins; VMs made from it keep running)",
		Args:    needArgs("an image NAME"),
		RunE: a.withClientArgs(func(ctx context.Context, c *client, args []string) error {
			r, err := c.image.DeleteImage(ctx, connect.NewRequest(&eitriv1.DeleteImageRequest{Name: args[0]}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { fmt.Fprintf(w, "removed %s\n", args[0]) })
		}),
	}
}

func newImageRefreshCmd(a *app) *cobra.Command {
	var url string
	cmd := &cobra.Command{
		Use:   "refresh NAME [--url URL]",
		Short: "Resolve an image again from its SUMS file (admins)",
		Args:  needArgs("an image NAME"),
		RunE: a.withClientArgs(func(ctx context.Context, c *client, args []string) error {
			r, err := c.image.RefreshImage(ctx, connect.NewRequest(&eitriv1.RefreshImageRequest{Name: args[0], Url: url}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) {
				cur := r.Msg.Image.GetCurrent()
				if r.Msg.Changed {
					fmt.Fprintf(w, "%s now at version %d (sha256 %s)\n", args[0], cur.GetVersion(), cur.GetSha256())
				} else {
					fmt.Fprintf(w, "%s unchanged at version %d (sha256 %s)\n", args[0], cur.GetVersion(), cur.GetSha256())
				}
			})
		}),
	}
	cmd.Flags().StringVar(&url, "url", "", "the image's URL from now on (default: the current one)")
	return cmd
}

func imageTable(w io.Writer, imgs ...*eitriv1.Image) {
	fmt.Fprintln(w, "NAME\tVERSION\tOS\tARCH\tMIN\tREADY BY\tHELD BY\tSHA256\tDESCRIPTION")
	for _, i := range imgs {
		p := i.GetProperties()
		os := strings.TrimSpace(p.GetOs() + " " + p.GetOsVersion())
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", i.Name, i.GetCurrent().GetVersion(), dash(os), dash(p.GetArchitecture()),
			minimums(p), readinessWord(p.GetReadiness()), heldCount(i), short(i.GetCurrent().GetSha256()), p.GetDescription())
	}
}

func minimums(p *eitriv1.ImageProperties) string {
	if p.GetMinDiskGb() == 0 && p.GetMinMemMb() == 0 {
		return "-"
	}
	return fmt.Sprintf("%dM/%dG", p.GetMinMemMb(), p.GetMinDiskGb())
}

// short is enough of a digest to tell images apart at a glance; -o json
// has the whole of it.
func short(sha string) string {
	if len(sha) > 12 {
		return sha[:12] + "…"
	}
	return dash(sha)
}

func imageDetail(w io.Writer, i *eitriv1.Image) {
	p := i.GetProperties()
	rows := [][2]string{
		{"name", i.Name}, {"description", dash(p.GetDescription())},
		{"os", dash(strings.TrimSpace(p.GetOs() + " " + p.GetOsVersion()))}, {"arch", dash(p.GetArchitecture())},
		{"login user", dash(p.GetLoginUser())}, {"minimum", fmt.Sprintf("%d MiB memory, %d GiB disk", p.GetMinMemMb(), p.GetMinDiskGb())},
		{"ready by", readinessWord(p.GetReadiness())}, {"keyring", map[bool]string{true: "pinned", false: dash("")}[i.KeyringPinned]},
	}
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\n", r[0], r[1])
	}
	for _, h := range i.Hosts {
		fmt.Fprintf(w, "host %s\t%s\n", cmpOr(h.HostName, h.HostId), pullLine(h))
	}
	for _, v := range i.Versions {
		mark := ""
		if v.GetVersion() == i.GetCurrent().GetVersion() {
			mark = " (current)"
		}
		fmt.Fprintf(w, "version %d%s\t%s\n", v.GetVersion(), mark, v.GetUrl())
		fmt.Fprintf(w, "  sha256\t%s\n", v.GetSha256())
		if v.GetSha512() != "" {
			fmt.Fprintf(w, "  sha512\t%s\n", v.GetSha512())
		}
		pv := v.GetProvenance()
		if pv.GetSumsUrl() != "" {
			fmt.Fprintf(w, "  from\t%s\n", pv.GetSumsUrl())
		}
		if pv.GetSigner() != "" {
			fmt.Fprintf(w, "  signed by\t%s\n", pv.GetSigner())
		}
		if pv.GetVerifiedAt() != nil {
			fmt.Fprintf(w, "  verified\t%s\n", when(pv.GetVerifiedAt().AsTime()))
		}
	}
}

func newImagePullCmd(a *app) *cobra.Command {
	var hosts []string
	var all, noWait bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "pull NAME (--host H ... | --all)",
		Short: "Fetch an image into hosts' caches ahead of creates, pinned until it leaves the catalogue (admins)",
		Long: `Fetch an image into hosts' caches ahead of creates (admins). Each host keeps
the image's current version pinned against eviction until the image is
removed from the catalogue, so a create there starts without a download.
Follows each host's download until all hold it (exit 0) or one fails
(exit 1); --no-wait returns at once.`,
		Args: needArgs("an image NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			if all == (len(hosts) > 0) {
				return Usagef("name the hosts with --host, or give --all")
			}
			c, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			req := &eitriv1.PullImageRequest{Name: args[0], All: all}
			for _, h := range hosts {
				id, err := c.hostID(ctx, h)
				if err != nil {
					return err
				}
				req.HostIds = append(req.HostIds, id)
			}
			r, err := c.image.PullImage(ctx, connect.NewRequest(req))
			if err != nil {
				return apiError(err)
			}
			if noWait {
				return c.show(r.Msg, func(w io.Writer) { imageHostsTable(w, r.Msg.Image.Hosts...) })
			}
			if timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, timeout)
				defer cancel()
			}
			return c.followPull(ctx, args[0], req.HostIds)
		},
	}
	fs := cmd.Flags()
	fs.StringSliceVar(&hosts, "host", nil, "host name or id (repeat, or comma-separate)")
	fs.BoolVar(&all, "all", false, "every host")
	fs.BoolVar(&noWait, "no-wait", false, "return once the hosts are told, without following them")
	fs.DurationVar(&timeout, "timeout", 0, "give up following after this long (default: no limit)")
	return cmd
}

// followPull says each host's step as it changes, until every host asked
// (every host the image was pulled to, for --all) holds the image or one
// has failed. The image's watch stream pushes each step; a dropped stream
// is opened again, and its snapshot says where things stand.
func (c *client) followPull(ctx context.Context, name string, only []string) error {
	want := map[string]bool{}
	for _, id := range only {
		want[id] = true
	}
	said := map[string]string{}
	for {
		done, err := c.followPullStream(ctx, name, want, said)
		if done || ctx.Err() != nil {
			if err == nil && ctx.Err() != nil {
				err = fmt.Errorf("stopped following the pull of %s: %w (the hosts go on)", name, ctx.Err())
			}
			return err
		}
		if connect.CodeOf(err) != connect.CodeUnavailable {
			return apiError(err)
		}
		select {
		case <-ctx.Done():
		case <-time.After(time.Second):
		}
	}
}

// followPullStream follows one watch stream; done says the pull ended
// (err is then its outcome), else err is why the stream did.
func (c *client) followPullStream(ctx context.Context, name string, want map[string]bool, said map[string]string) (bool, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.image.WatchImages(ctx, connect.NewRequest(&eitriv1.WatchImagesRequest{Name: name}))
	if err != nil {
		return false, err
	}
	defer st.Close()
	for st.Receive() {
		m := st.Msg()
		var img *eitriv1.Image
		switch {
		case m.GetRemovedName() != "":
			return true, fmt.Errorf("%s was removed from the catalogue while it was being pulled", name)
		case m.GetChanged() != nil:
			img = m.GetChanged()
		case len(m.GetSnapshot().GetImages()) == 1:
			img = m.GetSnapshot().GetImages()[0]
		default:
			continue
		}
		if done, err := c.pullStep(img, want, said); done {
			return true, err
		}
	}
	return false, st.Err()
}

// pullStep prints what moved on img's hosts and says whether the pull is
// over (every host holds it or failed).
func (c *client) pullStep(img *eitriv1.Image, want map[string]bool, said map[string]string) (bool, error) {
	done, failed := 0, 0
	var on []*eitriv1.ImageOnHost
	for _, h := range img.Hosts {
		if len(want) == 0 || want[h.HostId] {
			on = append(on, h)
		}
	}
	if len(on) == 0 {
		return true, fmt.Errorf("no host to pull %s to", img.Name)
	}
	for _, h := range on {
		line := pullLine(h)
		if said[h.HostId] != line {
			said[h.HostId] = line
			if c.format == formatTable {
				fmt.Fprintf(c.out, "%s %s: %s\n", time.Now().Format("15:04:05"), cmpOr(h.HostName, h.HostId), line)
			}
		}
		switch h.State {
		case "held":
			done++
		case "failed":
			failed++
		}
	}
	if done+failed < len(on) {
		return false, nil
	}
	if c.format != formatTable {
		if err := c.show(&eitriv1.GetImageResponse{Image: img}, nil); err != nil {
			return true, err
		}
	}
	if failed > 0 {
		return true, fmt.Errorf("%d of %d hosts could not pull %s", failed, len(on), img.Name)
	}
	return true, nil
}

func cmpOr(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

// pullLine is one host's state in words.
func pullLine(h *eitriv1.ImageOnHost) string {
	switch h.State {
	case "held":
		return "holds it (pinned)"
	case "failed":
		return "failed: " + h.Error + " (the host tries again)"
	case "pulling":
		if p := h.Progress; p != nil && p.TotalBytes != nil && *p.TotalBytes > 0 {
			return fmt.Sprintf("%s (%d%%)", cmpOr(h.StatusDetail, "pulling"), p.DoneBytes*100 / *p.TotalBytes)
		}
		return cmpOr(h.StatusDetail, "pulling")
	}
	return "not reporting on it yet"
}

func imageHostsTable(w io.Writer, hosts ...*eitriv1.ImageOnHost) {
	fmt.Fprintln(w, "HOST\tSTATE")
	for _, h := range hosts {
		fmt.Fprintf(w, "%s\t%s\n", cmpOr(h.HostName, h.HostId), pullLine(h))
	}
}

// heldCount is "2/3" hosts holding the image of those it was pulled to.
func heldCount(i *eitriv1.Image) string {
	if len(i.Hosts) == 0 {
		return dash("")
	}
	n := 0
	for _, h := range i.Hosts {
		if h.State == "held" {
			n++
		}
	}
	return fmt.Sprintf("%d/%d", n, len(i.Hosts))
}
