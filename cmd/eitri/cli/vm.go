package cli

import (
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
	"github.com/a73x/eitri/wire/vmstate"
)

func newVMCmd(a *app) *cobra.Command {
	cmd := noun("vm", "Create, run and watch VMs",
		newVMCreateCmd(a),
		newVMListCmd(a),
		newVMGetCmd(a),
		vmAction(a, "start", "Start a stopped VM", true,
			byID(eitriv1connect.VMServiceClient.StartVM, func(id string) *eitriv1.StartVMRequest { return &eitriv1.StartVMRequest{Id: id} })),
		vmAction(a, "stop", "Stop a running VM", true,
			byID(eitriv1connect.VMServiceClient.StopVM, func(id string) *eitriv1.StopVMRequest { return &eitriv1.StopVMRequest{Id: id} })),
		vmAction(a, "rm", "Delete a VM (restorable for the delete grace)", false,
			byID(eitriv1connect.VMServiceClient.DeleteVM, func(id string) *eitriv1.DeleteVMRequest { return &eitriv1.DeleteVMRequest{Id: id} }), "delete"),
		vmAction(a, "restore", "Take back a deleted VM before it is destroyed", true,
			byID(eitriv1connect.VMServiceClient.RestoreVM, func(id string) *eitriv1.RestoreVMRequest { return &eitriv1.RestoreVMRequest{Id: id} })),
		vmAction(a, "retry", "Try a failed VM again, with a fresh budget", true,
			byID(eitriv1connect.VMServiceClient.RetryVM, func(id string) *eitriv1.RetryVMRequest { return &eitriv1.RetryVMRequest{Id: id} })),
		newVMEventsCmd(a),
		newVMWatchCmd(a),
		newVMTopCmd(a),
		newVMStatsCmd(a),
		newVMConsoleCmd(a),
		newVMLogsCmd(a),
		newVMWaitCmd(a),
		newVMOrphansCmd(a),
		newVMAdoptCmd(a),
		newVMDestroyOrphanCmd(a),
	)
	a.addOutputFlag(cmd)
	return cmd
}

type createFlags struct {
	image, sha, host, sshKey string
	vcpus                    int
	mem, disk                int64
	stopped, wait            bool
	timeout                  time.Duration
}

func newVMCreateCmd(a *app) *cobra.Command {
	var f createFlags
	cmd := &cobra.Command{
		Use:   "create NAME --image NAME|URL [--sha256 HEX]",
		Short: "Create a VM (--wait follows it until it is ready)",
		Example: `  eitri vm create web-1 --image debian-12 --wait
  eitri vm create web-2 --image https://example.org/debian.raw --sha256 3f0c… --mem-mb 1024 --wait
  eitri vm create db-1 --image … --sha256 … --ssh-key ~/.ssh/id_ed25519.pub --stopped`,
		Args: needArgs("a NAME"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			req := &eitriv1.CreateVMRequest{Name: args[0], Vcpus: int32(f.vcpus), MemMb: f.mem, DiskGb: f.disk, SshAuthorizedKey: sshKey(f.sshKey)}
			if isImageURL(f.image, f.sha) {
				req.ImageUrl, req.ImageSha256 = f.image, f.sha
			} else if err := c.byImageName(ctx, cmd, req, f.image); err != nil {
				return err
			}
			if f.stopped {
				req.PowerState = vmstate.PowerStopped
			}
			if f.host != "" {
				if req.HostId, err = c.hostID(ctx, f.host); err != nil {
					return err
				}
			}
			r, err := c.vm.CreateVM(ctx, connect.NewRequest(req))
			if err != nil {
				return apiError(err)
			}
			if !f.wait {
				return c.show(r.Msg, func(w io.Writer) { vmTable(w, r.Msg.Vm) })
			}
			if c.format == formatTable {
				fmt.Fprintf(c.out, "created %s (%s) on %s\n", r.Msg.Vm.Name, r.Msg.Vm.Id, r.Msg.Vm.HostId)
			}
			return c.waitAndShow(ctx, r.Msg.Vm.Id, f.timeout)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&f.image, "image", "", "a catalogue image name (eitri image ls), or an image URL (http or https) with --sha256")
	fs.StringVar(&f.sha, "sha256", "", "with an image URL: its sha256 (64 lowercase hex)")
	fs.IntVar(&f.vcpus, "vcpus", 1, "vCPUs")
	fs.Int64Var(&f.mem, "mem-mb", 512, "memory in MiB")
	fs.Int64Var(&f.disk, "disk-gb", 4, "disk in GiB")
	fs.StringVar(&f.host, "host", "", "host name or id (default: automatic placement)")
	fs.StringVar(&f.sshKey, "ssh-key", "", "SSH public key, or a file holding one")
	fs.BoolVar(&f.stopped, "stopped", false, "create without starting")
	addWaitFlags(fs, &f.wait, &f.timeout)
	return cmd
}

// isImageURL says whether --image is an ad-hoc image's URL rather than a
// catalogue name (which is a DNS label, so never has a scheme).
func isImageURL(image, sha string) bool {
	return sha != "" || strings.Contains(image, "://")
}

// byImageName makes req create from the catalogue image name. Sizes left
// at their defaults are raised to the image's minimums, so the defaults
// never make a create the image would refuse.
func (c *client) byImageName(ctx context.Context, cmd *cobra.Command, req *eitriv1.CreateVMRequest, name string) error {
	if name == "" {
		return Usagef("--image: required (a catalogue name, or a URL with --sha256)")
	}
	req.Image = name
	r, err := c.image.GetImage(ctx, connect.NewRequest(&eitriv1.GetImageRequest{Name: name}))
	if err != nil {
		if connect.CodeOf(err) == connect.CodeNotFound {
			return Usagef("--image: no image named %q in the catalogue (eitri image ls), and not a URL", name)
		}
		return apiError(err)
	}
	p := r.Msg.Image.GetProperties()
	if !flagGiven(cmd.Flags(), "disk-gb") {
		req.DiskGb = max(req.DiskGb, p.GetMinDiskGb())
	}
	if !flagGiven(cmd.Flags(), "mem-mb") {
		req.MemMb = max(req.MemMb, p.GetMinMemMb())
	}
	return nil
}

// sshKey is the key itself, read from the file when arg names one.
func sshKey(arg string) string {
	if b, err := os.ReadFile(arg); arg != "" && err == nil {
		return strings.TrimSpace(string(b))
	}
	return arg
}

// waitAndShow follows the VM until it settles; under -o json|yaml it
// prints the settled VM.
func (c *client) waitAndShow(ctx context.Context, id string, timeout time.Duration) error {
	v, err := c.waitFor(ctx, id, timeout)
	if err != nil {
		return err
	}
	if c.format == formatTable {
		return nil // the narration's last line said it
	}
	return c.show(&eitriv1.GetVMResponse{Vm: v}, nil)
}

type flagAdder interface {
	BoolVar(p *bool, name string, value bool, usage string)
	DurationVar(p *time.Duration, name string, value time.Duration, usage string)
}

func addWaitFlags(fs flagAdder, wait *bool, timeout *time.Duration) {
	fs.BoolVar(wait, "wait", false, "follow the VM, narrating each step, until it is ready (exit 0) or failed (exit 1)")
	fs.DurationVar(timeout, "timeout", 0, "with --wait: give up after this long (default: no limit)")
}

func newVMListCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List your VMs (an admin sees everyone's)",
		Args:    NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.vm.ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { vmTable(w, r.Msg.Vms...) })
		}),
	}
}

func newVMGetCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:               "get NAME|ID",
		Short:             "Show one VM",
		Args:              needArgs("a VM name or id"),
		ValidArgsFunction: a.completeVMs,
		RunE: a.onVM(func(ctx context.Context, c *client, id string) error {
			r, err := c.vm.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { vmDetail(w, r.Msg.Vm) })
		}),
	}
}

// byID makes a vmAction's call from a VMService method that takes a VM id
// and answers with the VM.
func byID[Req, Resp any, PResp interface {
	*Resp
	vmReply
}](call func(eitriv1connect.VMServiceClient, context.Context, *connect.Request[Req]) (*connect.Response[Resp], error), req func(id string) *Req) func(context.Context, *client, string) (vmReply, error) {
	return func(ctx context.Context, c *client, id string) (vmReply, error) {
		r, err := call(c.vm, ctx, connect.NewRequest(req(id)))
		if err != nil {
			return nil, err
		}
		return PResp(r.Msg), nil
	}
}

// vmReply is every response that carries the VM it acted on.
type vmReply interface {
	proto.Message
	GetVm() *eitriv1.VM
}

// vmAction is a verb on one VM, named or by id, that answers with the VM;
// waitable ones take --wait.
func vmAction(a *app, verb, short string, waitable bool, call func(context.Context, *client, string) (vmReply, error), aliases ...string) *cobra.Command {
	var wait bool
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:               verb + " NAME|ID",
		Aliases:           aliases,
		Short:             short,
		Args:              needArgs("a VM name or id"),
		ValidArgsFunction: a.completeVMs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			id, err := c.vmID(ctx, args[0])
			if err != nil {
				return err
			}
			r, err := call(ctx, c, id)
			if err != nil {
				return apiError(err)
			}
			if wait {
				return c.waitAndShow(ctx, id, timeout)
			}
			return c.show(r, func(w io.Writer) { vmTable(w, r.GetVm()) })
		},
	}
	if waitable {
		addWaitFlags(cmd.Flags(), &wait, &timeout)
	}
	return cmd
}

func newVMWaitCmd(a *app) *cobra.Command {
	var timeout time.Duration
	cmd := &cobra.Command{
		Use:   "wait NAME|ID",
		Short: "Follow a VM, narrating each step, until it is ready (exit 0) or failed (exit 1)",
		Long: `Follow a VM over the watch stream until it settles, one line per step
the host narrates and a progress bar for a download (on a terminal; plain
lines otherwise). A ready VM's address is the last line; a failed one's
error is the command's own, with exit status 1.`,
		Args:              needArgs("a VM name or id"),
		ValidArgsFunction: a.completeVMs,
		RunE: a.onVM(func(ctx context.Context, c *client, id string) error {
			return c.waitAndShow(ctx, id, timeout)
		}),
	}
	cmd.Flags().DurationVar(&timeout, "timeout", 0, "give up after this long (default: no limit)")
	return cmd
}

func newVMEventsCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:               "events NAME|ID",
		Short:             "What happened to a VM, oldest first",
		Args:              needArgs("a VM name or id"),
		ValidArgsFunction: a.completeVMs,
		RunE: a.onVM(func(ctx context.Context, c *client, id string) error {
			// Pages come newest first, each oldest first: read them all
			// and put each before the one read last.
			all := &eitriv1.ListVMEventsResponse{}
			req := &eitriv1.ListVMEventsRequest{VmId: id, PageSize: 1000} // the largest page
			for {
				r, err := c.vm.ListVMEvents(ctx, connect.NewRequest(req))
				if err != nil {
					return apiError(err)
				}
				all.Events = append(r.Msg.Events, all.Events...)
				if r.Msg.NextPageToken == "" {
					break
				}
				req.PageToken = r.Msg.NextPageToken
			}
			return c.show(all, func(w io.Writer) { eventTable(w, all.Events...) })
		}),
	}
}

func newVMWatchCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "watch",
		Short: "Every VM now, then each change as it happens",
		Args:  NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			return c.watchVMs(ctx)
		}),
	}
}

func (c *client) watchVMs(ctx context.Context) error {
	st, err := c.vm.WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	if err != nil {
		return apiError(err)
	}
	defer st.Close()
	for st.Receive() {
		m := st.Msg()
		switch {
		case c.format == formatJSON:
			b, err := encode(m, formatJSON, false)
			if err != nil {
				return err
			}
			_, _ = c.out.Write(b)
		case c.format == formatYAML:
			b, err := encode(m, formatYAML, false)
			if err != nil {
				return err
			}
			_, _ = fmt.Fprintf(c.out, "---\n%s", b)
		case m.GetSnapshot() != nil:
			tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
			vmTable(tw, m.GetSnapshot().Vms...)
			_ = tw.Flush()
		case m.GetChanged() != nil:
			v := m.GetChanged()
			fmt.Fprintf(c.out, "%s %s %s %s\n", time.Now().Format(time.TimeOnly), v.Name, v.Lifecycle, statusLine(v))
		case m.GetRemovedId() != "":
			fmt.Fprintf(c.out, "%s %s removed\n", time.Now().Format(time.TimeOnly), m.GetRemovedId())
		}
	}
	if ctx.Err() != nil {
		return nil
	}
	return apiError(st.Err())
}

func newVMOrphansCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "orphans",
		Short: "Admins: VMs hosts hold but this control plane lost or has older records of",
		Args:  NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.vm.ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { orphanTable(w, r.Msg.Vms...) })
		}),
	}
}

func newVMAdoptCmd(a *app) *cobra.Command {
	var owner, name string
	cmd := &cobra.Command{
		Use:   "adopt HOST VM_ID",
		Short: "Admins: take an orphaned VM back into this control plane",
		Args:  needArgs("a HOST id and a VM id (eitri vm orphans lists them)", "a VM id (eitri vm orphans lists them)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			hostID, err := c.hostID(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			r, err := c.vm.AdoptOrphanedVM(cmd.Context(), connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{
				HostId: hostID, VmId: args[1], OwnerId: owner, Name: name}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { vmTable(w, r.Msg.Vm) })
		},
	}
	cmd.Flags().StringVar(&owner, "owner", "", "the user id to give an orphaned VM whose owner is unknown here")
	cmd.Flags().StringVar(&name, "name", "", "a name for the VM when its owner already uses the recorded one")
	return cmd
}

func newVMDestroyOrphanCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "destroy-orphan HOST VM_ID",
		Short: "Admins: have a host destroy an orphaned VM and its disk",
		Args:  needArgs("a HOST id and a VM id (eitri vm orphans lists them)", "a VM id (eitri vm orphans lists them)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			hostID, err := c.hostID(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			if _, err := c.vm.DestroyOrphanedVM(cmd.Context(), connect.NewRequest(&eitriv1.DestroyOrphanedVMRequest{HostId: hostID, VmId: args[1]})); err != nil {
				return apiError(err)
			}
			fmt.Fprintf(c.out, "host %s destroys %s and its disk\n", args[0], args[1])
			return nil
		},
	}
}
