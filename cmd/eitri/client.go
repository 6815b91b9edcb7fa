package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/a73x/eitri/agent/syncclient"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/gen/go/eitri/v1/eitriv1connect"
)

type client struct {
	vm    eitriv1connect.VMServiceClient
	host  eitriv1connect.HostServiceClient
	exp   eitriv1connect.ExposureServiceClient
	token eitriv1connect.TokenServiceClient
	quota eitriv1connect.QuotaServiceClient
	out   io.Writer
	json  bool
}

func newClient(out io.Writer, asJSON bool) (*client, error) {
	base := os.Getenv("EITRI_URL")
	if base == "" {
		base = "http://127.0.0.1:8080"
	}
	tok := os.Getenv("EITRI_TOKEN")
	if tok == "" {
		return nil, errors.New("EITRI_TOKEN is not set (the first admin token is in <data-dir>/admin.token)")
	}
	var hc *http.Client
	switch {
	case strings.HasPrefix(base, "http://"):
		hc = syncclient.HTTPClient("")
	case os.Getenv("EITRI_FINGERPRINT") != "":
		hc = syncclient.HTTPClient(os.Getenv("EITRI_FINGERPRINT"))
	default:
		hc = http.DefaultClient
	}
	opt := connect.WithInterceptors(syncclient.Bearer(tok))
	return &client{
		vm:    eitriv1connect.NewVMServiceClient(hc, base, opt),
		host:  eitriv1connect.NewHostServiceClient(hc, base, opt),
		exp:   eitriv1connect.NewExposureServiceClient(hc, base, opt),
		token: eitriv1connect.NewTokenServiceClient(hc, base, opt),
		quota: eitriv1connect.NewQuotaServiceClient(hc, base, opt),
		out:   out, json: asJSON,
	}, nil
}

var jsonOut = protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true, Multiline: true}

func (c *client) print(m proto.Message, table func(w io.Writer)) error {
	if c.json {
		b, err := jsonOut.Marshal(m)
		if err != nil {
			return err
		}
		_, err = fmt.Fprintln(c.out, string(b))
		return err
	}
	tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
	table(tw)
	return tw.Flush()
}

func cmdClient(ctx context.Context, noun string, args []string, out io.Writer) error {
	if len(args) == 0 {
		return usagef("eitri %s needs a subcommand", noun)
	}
	verb, args := args[0], args[1:]
	if noun == "quota" {
		return cmdQuota(ctx, verb, args, out)
	}
	fs := flag.NewFlagSet(noun+" "+verb, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	output := fs.String("o", "table", "output: table or json")
	// Flags used by some verbs; parsed for all so order never matters.
	image := fs.String("image", "", "image URL (http or https)")
	sha := fs.String("sha256", "", "image sha256 (64 lowercase hex)")
	vcpus := fs.Int("vcpus", 1, "vCPUs")
	mem := fs.Int64("mem-mb", 512, "memory in MiB")
	disk := fs.Int64("disk-gb", 4, "disk in GiB")
	host := fs.String("host", "", "host id (default: automatic placement)")
	sshKey := fs.String("ssh-key", "", "SSH public key, or a file holding one")
	stopped := fs.Bool("stopped", false, "create without starting")
	ttl := fs.Duration("ttl", 0, "lifetime")
	user := fs.String("user", "", "admins: mint the token for this user")
	hostPort := fs.Uint("host-port", 0, "host port (default: allocated)")
	udp := fs.Bool("udp", false, "UDP instead of TCP")
	local := fs.Bool("local", false, "listen on the host's loopback only")
	maxSessions := fs.Uint("max", 0, "cap on concurrent connections/sessions")
	force := fs.Bool("force", false, "host decommission: the host is gone for good; its VMs are marked lost")
	owner := fs.String("owner", "", "vm adopt: the user id to give an orphaned VM whose owner is unknown here")
	newName := fs.String("name", "", "vm adopt: a name for the VM when its owner already uses the recorded one")
	pos, err := parse(fs, args)
	if err != nil {
		return err
	}
	c, err := newClient(out, *output == "json")
	if err != nil {
		return err
	}
	need := func(n int, what string) error {
		if len(pos) < n {
			return usagef("eitri %s %s needs %s", noun, verb, what)
		}
		return nil
	}
	var callErr error
	switch noun + " " + verb {
	case "vm create":
		if err := need(1, "a NAME"); err != nil {
			return err
		}
		key := *sshKey
		if b, err := os.ReadFile(key); key != "" && err == nil {
			key = strings.TrimSpace(string(b))
		}
		power := ""
		if *stopped {
			power = "stopped"
		}
		r, err := c.vm.CreateVM(ctx, connect.NewRequest(&eitriv1.CreateVMRequest{
			Name: pos[0], ImageUrl: *image, ImageSha256: *sha, Vcpus: int32(*vcpus), MemMb: *mem, DiskGb: *disk,
			HostId: *host, SshAuthorizedKey: key, PowerState: power,
		}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { vmTable(w, r.Msg.Vm) })
		}
		callErr = err
	case "vm ls":
		r, err := c.vm.ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { vmTable(w, r.Msg.Vms...) })
		}
		callErr = err
	case "vm get":
		if err := need(1, "a VM id"); err != nil {
			return err
		}
		r, err := c.vm.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: pos[0]}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { vmDetail(w, r.Msg.Vm) })
		}
		callErr = err
	case "vm start", "vm stop", "vm rm", "vm restore":
		if err := need(1, "a VM id"); err != nil {
			return err
		}
		var vm *eitriv1.VM
		var m proto.Message
		switch verb {
		case "start":
			r, err := c.vm.StartVM(ctx, connect.NewRequest(&eitriv1.StartVMRequest{Id: pos[0]}))
			if callErr = err; err == nil {
				vm, m = r.Msg.Vm, r.Msg
			}
		case "stop":
			r, err := c.vm.StopVM(ctx, connect.NewRequest(&eitriv1.StopVMRequest{Id: pos[0]}))
			if callErr = err; err == nil {
				vm, m = r.Msg.Vm, r.Msg
			}
		case "rm":
			r, err := c.vm.DeleteVM(ctx, connect.NewRequest(&eitriv1.DeleteVMRequest{Id: pos[0]}))
			if callErr = err; err == nil {
				vm, m = r.Msg.Vm, r.Msg
			}
		case "restore":
			r, err := c.vm.RestoreVM(ctx, connect.NewRequest(&eitriv1.RestoreVMRequest{Id: pos[0]}))
			if callErr = err; err == nil {
				vm, m = r.Msg.Vm, r.Msg
			}
		}
		if callErr == nil {
			return c.print(m, func(w io.Writer) { vmTable(w, vm) })
		}
	case "vm retry":
		if err := need(1, "a VM name or id"); err != nil {
			return err
		}
		id, err := c.vmID(ctx, pos[0])
		if err != nil {
			return err
		}
		r, err := c.vm.RetryVM(ctx, connect.NewRequest(&eitriv1.RetryVMRequest{Id: id}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { vmTable(w, r.Msg.Vm) })
		}
		callErr = err
	case "vm events":
		if err := need(1, "a VM id"); err != nil {
			return err
		}
		r, err := c.vm.ListVMEvents(ctx, connect.NewRequest(&eitriv1.ListVMEventsRequest{VmId: pos[0]}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) {
				for _, e := range r.Msg.Events {
					// An exit's message carries console lines: they go
					// under it, indented, not into the table.
					first, rest, _ := strings.Cut(e.Message, "\n")
					fmt.Fprintf(w, "%s\t%s\t%s\n", e.At.AsTime().Local().Format(time.DateTime), e.Kind, first)
					if rest != "" {
						fmt.Fprintf(w, "\t\t  %s\n", strings.ReplaceAll(rest, "\n", "\n\t\t  "))
					}
				}
			})
		}
		callErr = err
	case "vm watch":
		return c.watchVMs(ctx)
	case "vm orphans":
		r, err := c.vm.ListOrphanedVMs(ctx, connect.NewRequest(&eitriv1.ListOrphanedVMsRequest{}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { orphanTable(w, r.Msg.Vms...) })
		}
		callErr = err
	case "vm adopt":
		if err := need(2, "a HOST id and a VM id (eitri vm orphans lists them)"); err != nil {
			return err
		}
		r, err := c.vm.AdoptOrphanedVM(ctx, connect.NewRequest(&eitriv1.AdoptOrphanedVMRequest{HostId: pos[0], VmId: pos[1], OwnerId: *owner, Name: *newName}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { vmTable(w, r.Msg.Vm) })
		}
		callErr = err
	case "vm destroy-orphan":
		if err := need(2, "a HOST id and a VM id (eitri vm orphans lists them)"); err != nil {
			return err
		}
		_, callErr = c.vm.DestroyOrphanedVM(ctx, connect.NewRequest(&eitriv1.DestroyOrphanedVMRequest{HostId: pos[0], VmId: pos[1]}))
		if callErr == nil {
			fmt.Fprintf(out, "host %s destroys %s and its disk\n", pos[0], pos[1])
			return nil
		}
	case "host ls":
		r, err := c.host.ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { hostTable(w, r.Msg.Hosts...) })
		}
		callErr = err
	case "host get":
		if err := need(1, "a host id"); err != nil {
			return err
		}
		r, err := c.host.GetHost(ctx, connect.NewRequest(&eitriv1.GetHostRequest{Id: pos[0]}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { hostTable(w, r.Msg.Host) })
		}
		callErr = err
	case "host join-token":
		req := &eitriv1.CreateJoinTokenRequest{}
		if *ttl > 0 {
			req.Ttl = durationpb.New(*ttl)
		}
		r, err := c.host.CreateJoinToken(ctx, connect.NewRequest(req))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) {
				fmt.Fprintf(w, "Run this on the new host (single use, expires %s):\n\n  %s\n", r.Msg.ExpiresAt.AsTime().Local().Format(time.DateTime), r.Msg.Command)
			})
		}
		callErr = err
	case "host decommission":
		if err := need(1, "a host id"); err != nil {
			return err
		}
		r, err := c.host.DecommissionHost(ctx, connect.NewRequest(&eitriv1.DecommissionHostRequest{Id: pos[0], Force: *force}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) {
				if !*force {
					fmt.Fprintln(w, "decommissioned", pos[0])
					return
				}
				fmt.Fprintf(w, "decommissioned %s by force\n", pos[0])
				if ids := r.Msg.GetLostVmIds(); len(ids) > 0 {
					fmt.Fprintf(w, "%d VM(s) marked lost (kept to read; eitri vm rm removes them): %s\n", len(ids), strings.Join(ids, " "))
				}
				if ids := r.Msg.GetForgottenVmIds(); len(ids) > 0 {
					fmt.Fprintf(w, "%d deleted VM(s) removed: %s\n", len(ids), strings.Join(ids, " "))
				}
			})
		}
		callErr = err
	case "expose create":
		if err := need(2, "a VM id and a guest port"); err != nil {
			return err
		}
		gp, err := strconv.ParseUint(pos[1], 10, 32)
		if err != nil {
			return usagef("guest port %q is not a number", pos[1])
		}
		proto, scope := "tcp", "lan"
		if *udp {
			proto = "udp"
		}
		if *local {
			scope = "local"
		}
		r, err := c.exp.CreateExposure(ctx, connect.NewRequest(&eitriv1.CreateExposureRequest{
			VmId: pos[0], GuestPort: uint32(gp), HostPort: uint32(*hostPort), Protocol: proto, Scope: scope, MaxSessions: uint32(*maxSessions),
		}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { exposureTable(w, r.Msg.Exposure) })
		}
		callErr = err
	case "expose ls":
		vmID := ""
		if len(pos) > 0 {
			vmID = pos[0]
		}
		r, err := c.exp.ListExposures(ctx, connect.NewRequest(&eitriv1.ListExposuresRequest{VmId: vmID}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) { exposureTable(w, r.Msg.Exposures...) })
		}
		callErr = err
	case "expose rm":
		if err := need(1, "an exposure id"); err != nil {
			return err
		}
		_, callErr = c.exp.DeleteExposure(ctx, connect.NewRequest(&eitriv1.DeleteExposureRequest{Id: pos[0]}))
		if callErr == nil {
			fmt.Fprintln(out, "removed", pos[0])
			return nil
		}
	case "token create":
		if err := need(1, "a NAME"); err != nil {
			return err
		}
		req := &eitriv1.CreateTokenRequest{Name: pos[0], UserName: *user}
		if *ttl > 0 {
			req.Ttl = durationpb.New(*ttl)
		}
		r, err := c.token.CreateToken(ctx, connect.NewRequest(req))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) {
				fmt.Fprintf(w, "token %s for %s (shown once):\n\n  %s\n", r.Msg.Token.Id, r.Msg.Token.UserName, r.Msg.Secret)
			})
		}
		callErr = err
	case "token ls":
		r, err := c.token.ListTokens(ctx, connect.NewRequest(&eitriv1.ListTokensRequest{}))
		if err == nil {
			return c.print(r.Msg, func(w io.Writer) {
				fmt.Fprintln(w, "ID\tNAME\tUSER\tCREATED\tEXPIRES\tLAST USED")
				for _, t := range r.Msg.Tokens {
					fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", t.Id, t.Name, t.UserName, when(t.CreatedAt.AsTime()), whenPB(t.ExpiresAt, "never"), whenPB(t.LastUsedAt, "never"))
				}
			})
		}
		callErr = err
	case "token revoke":
		if err := need(1, "a token id"); err != nil {
			return err
		}
		_, callErr = c.token.RevokeToken(ctx, connect.NewRequest(&eitriv1.RevokeTokenRequest{Id: pos[0]}))
		if callErr == nil {
			fmt.Fprintln(out, "revoked", pos[0])
			return nil
		}
	case "token sessions":
		return c.sessions(ctx)
	case "token end-session":
		if err := need(1, "a session id"); err != nil {
			return err
		}
		return c.endSession(ctx, pos[0])
	default:
		return usagef("unknown command: eitri %s %s", noun, verb)
	}
	return apiError(callErr)
}

// sessions lists console sessions and the token each acts for.
func (c *client) sessions(ctx context.Context) error {
	r, err := c.token.ListSessions(ctx, connect.NewRequest(&eitriv1.ListSessionsRequest{}))
	if err != nil {
		return apiError(err)
	}
	return c.print(r.Msg, func(w io.Writer) {
		fmt.Fprintln(w, "ID\tUSER\tTOKEN\tCREATED\tEXPIRES\tLAST USED")
		for _, s := range r.Msg.Sessions {
			fmt.Fprintf(w, "%s\t%s\t%s (%s)\t%s\t%s\t%s\n", s.Id, s.UserName, s.TokenName, s.TokenId,
				when(s.CreatedAt.AsTime()), whenPB(s.ExpiresAt, "never"), whenPB(s.LastUsedAt, "never"))
		}
	})
}

// endSession signs a console session out; its open pages lose their
// streams at once.
func (c *client) endSession(ctx context.Context, id string) error {
	if _, err := c.token.RevokeSession(ctx, connect.NewRequest(&eitriv1.RevokeSessionRequest{Id: id})); err != nil {
		return apiError(err)
	}
	fmt.Fprintln(c.out, "ended", id)
	return nil
}

// apiError words a Connect error for a terminal: the code, then the
// server's message (which names the field at fault).
func apiError(err error) error {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return fmt.Errorf("%s: %s", strings.ReplaceAll(ce.Code().String(), "_", " "), ce.Message())
	}
	return err
}

func (c *client) watchVMs(ctx context.Context) error {
	st, err := c.vm.WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	if err != nil {
		return apiError(err)
	}
	defer st.Close()
	for st.Receive() {
		m := st.Msg()
		if c.json {
			b, _ := protojson.MarshalOptions{UseProtoNames: true, EmitUnpopulated: true}.Marshal(m)
			fmt.Fprintln(c.out, string(b))
			continue
		}
		switch {
		case m.GetSnapshot() != nil:
			tw := tabwriter.NewWriter(c.out, 0, 4, 2, ' ', 0)
			vmTable(tw, m.GetSnapshot().Vms...)
			tw.Flush()
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

// statusLine is what a person reads beside the lifecycle: the host's
// sentence while creating, the error when failed, nothing when settled.
func statusLine(v *eitriv1.VM) string {
	switch {
	case inFlight(v.Lifecycle) && v.StatusDetail != "":
		return v.StatusDetail
	case v.Lifecycle == "failed", v.Lifecycle == "lost":
		return v.LastError
	case v.Deleted && v.RestorableUntil != nil:
		if time.Now().Before(v.RestorableUntil.AsTime()) {
			return "restorable until " + when(v.RestorableUntil.AsTime())
		}
		return "destroyed at " + when(v.DestroyAt.AsTime())
	}
	return ""
}

// inFlight says whether a lifecycle is work under way, whose host's
// narration is worth showing; a settled VM shows none.
func inFlight(lifecycle string) bool {
	switch lifecycle {
	case "creating", "starting", "stopping", "restarting", "restoring", "retrying":
		return true
	}
	return false
}

// vmID resolves what a person typed, a VM's id or its name, to its id. A
// name several visible VMs share (an admin sees every owner's) is refused
// with their ids.
func (c *client) vmID(ctx context.Context, arg string) (string, error) {
	_, err := c.vm.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: arg}))
	if err == nil {
		return arg, nil
	}
	if connect.CodeOf(err) != connect.CodeNotFound {
		return "", err
	}
	list, err := c.vm.ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	if err != nil {
		return "", err
	}
	var ids []string
	for _, v := range list.Msg.Vms {
		if v.Name == arg {
			ids = append(ids, v.Id)
		}
	}
	switch len(ids) {
	case 0:
		return "", fmt.Errorf("no VM has the id or name %q", arg)
	case 1:
		return ids[0], nil
	}
	return "", fmt.Errorf("%d VMs are named %q (%s); give the id", len(ids), arg, strings.Join(ids, ", "))
}

// orphanTable lists VMs hosts hold without this control plane's trust in
// its record of them, with what the host recorded and why it holds them.
func orphanTable(w io.Writer, vms ...*eitriv1.OrphanedVM) {
	fmt.Fprintln(w, "HOST\tID\tNAME\tOWNER\tSIZE\tPOWER\tROW HERE\tSINCE\tWHY")
	for _, o := range vms {
		owner := o.OwnerId
		if o.OwnerName != "" {
			owner = o.OwnerName + " (" + o.OwnerId + ")"
		} else if owner != "" {
			owner += " (unknown here)"
		}
		power := dash(o.ActualPower) + " (held " + dash(o.PowerState) + ")"
		if o.Deleted {
			power += ", deleted"
		}
		row := "none"
		if o.HasRow {
			row = "older"
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%dc/%dM/%dG\t%s\t%s\t%s\t%s\n", o.HostId, o.VmId, o.Name, dash(owner), o.Vcpus, o.MemMb, o.DiskGb,
			power, row, whenPB(o.Since, "—"), o.Reason)
	}
}

func vmTable(w io.Writer, vms ...*eitriv1.VM) {
	fmt.Fprintln(w, "ID\tNAME\tHOST\tSIZE\tSTATUS\tPOWER\tADDRESS\t")
	for _, v := range vms {
		fmt.Fprintf(w, "%s\t%s\t%s\t%dc/%dM/%dG\t%s\t%s\t%s\t%s\n", v.Id, v.Name, v.HostId, v.Vcpus, v.MemMb, v.DiskGb,
			v.Lifecycle, dash(v.ActualPower), dash(v.AssignedIp), statusLine(v))
	}
}

func vmDetail(w io.Writer, v *eitriv1.VM) {
	rows := [][2]string{
		{"id", v.Id}, {"name", v.Name}, {"host", v.HostId}, {"status", v.Lifecycle + " " + statusLine(v)},
		{"power", dash(v.ActualPower) + " (desired " + v.PowerState + ")"}, {"address", dash(v.AssignedIp) + " (host-local NAT)"},
		{"size", fmt.Sprintf("%d vCPU, %d MiB, %d GiB", v.Vcpus, v.MemMb, v.DiskGb)}, {"image", v.ImageUrl},
		{"sha256", v.ImageSha256}, {"created", when(v.CreatedAt.AsTime())},
	}
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%s\n", r[0], r[1])
	}
}

func hostTable(w io.Writer, hosts ...*eitriv1.Host) {
	fmt.Fprintln(w, "ID\tNAME\tCONNECTED\tACCEL\tADDRESS\tCPU\tMEMORY\tDISK\tVERSION\tNOTES")
	for _, h := range hosts {
		use := func(a, c int64) string {
			if h.Capacity == nil {
				return fmt.Sprintf("%d/?", a)
			}
			return fmt.Sprintf("%d/%d", a, c)
		}
		fmt.Fprintf(w, "%s\t%s\t%v\t%s\t%s\t%s\t%s MiB\t%s GiB\t%s\t%s\n", h.Id, h.Name, h.Connected, dash(h.Accelerator), dash(h.Address),
			use(int64(h.Allocated.GetVcpus()), int64(h.Capacity.GetVcpus())), use(h.Allocated.GetMemMb(), h.Capacity.GetMemMb()),
			use(h.Allocated.GetDiskGb(), h.Capacity.GetDiskGb()), dash(h.AgentVersion), hostNotes(h))
	}
}

// hostNotes is what a person should know about a host beyond the numbers:
// its ongoing problems first, then why it runs under its accelerator.
func hostNotes(h *eitriv1.Host) string {
	var notes []string
	for _, c := range h.Conditions {
		notes = append(notes, strings.ToUpper(strings.ReplaceAll(c.Type, "_", " "))+": "+c.Message)
	}
	if h.AcceleratorReason != "" {
		notes = append(notes, h.AcceleratorReason)
	}
	return strings.Join(notes, "; ")
}

func exposureTable(w io.Writer, exps ...*eitriv1.Exposure) {
	fmt.Fprintln(w, "ID\tVM\tPUBLISHED\tGUEST\tSTATE\tTRAFFIC")
	for _, e := range exps {
		addr := e.HostAddr
		if strings.Contains(addr, ":") {
			addr = "[" + addr + "]"
		}
		state := e.State
		if e.Reason != "" {
			state += " (" + e.Reason + ")"
		}
		fmt.Fprintf(w, "%s\t%s\t%s:%d/%s\t%d\t%s\t%s\n", e.Id, e.VmId, dash(addr), e.HostPort, e.Protocol, e.GuestPort, state, sessions(e.Sessions))
	}
}

// sessions words an exposure's counters, or nothing when its host did not
// count: null is never shown as zeros.
func sessions(s *eitriv1.ExposureSessions) string {
	if s == nil {
		return ""
	}
	return fmt.Sprintf("%d open · %d refused, %d dropped since agent start", s.Active, s.Refused, s.Dropped)
}

func dash(s string) string {
	if s == "" {
		return "—"
	}
	return s
}

func when(t time.Time) string { return t.Local().Format(time.DateTime) }

func whenPB(t *timestamppb.Timestamp, none string) string {
	if t == nil {
		return none
	}
	return when(t.AsTime())
}
