package cli

import (
	"context"
	"fmt"
	"io"
	"strconv"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// quotaLimits are the limits in the order people read them, with the
// flag (and API name) of each.
var quotaLimits = []struct{ flag, name string }{
	{"vms", "vms"}, {"vcpus", "vcpus"}, {"mem-mb", "mem_mb"}, {"disk-gb", "disk_gb"},
	{"exposures", "exposures"}, {"streams", "streams"},
}

// limitPtrs lists l's fields in quotaLimits order.
func limitPtrs(l *eitriv1.QuotaLimits) []**int64 {
	return []**int64{&l.Vms, &l.Vcpus, &l.MemMb, &l.DiskGb, &l.Exposures, &l.Streams}
}

// usageOf lists u's fields in quotaLimits order.
func usageOf(u *eitriv1.QuotaUsage) []int64 {
	return []int64{u.GetVms(), u.GetVcpus(), u.GetMemMb(), u.GetDiskGb(), u.GetExposures(), u.GetStreams()}
}

func newQuotaCmd(a *app) *cobra.Command {
	cmd := noun("quota", "Read and set what users may hold",
		newQuotaGetCmd(a), newQuotaSetCmd(a))
	a.addOutputFlag(cmd)
	return cmd
}

func newQuotaGetCmd(a *app) *cobra.Command {
	var user string
	cmd := &cobra.Command{
		Use:   "get",
		Short: "Show a quota: each limit, what is used and where the limit comes from",
		Args:  NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.quota.GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{UserName: user}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { quotaTable(w, r.Msg.Quota) })
		}),
	}
	cmd.Flags().StringVar(&user, "user", "", "the user (default: you)")
	return cmd
}

// newQuotaSetCmd has flags of its own: --vcpus and friends mean limits
// here, not a VM's size.
func newQuotaSetCmd(a *app) *cobra.Command {
	var user string
	var defaults bool
	values := make([]string, len(quotaLimits))
	cmd := &cobra.Command{
		Use:   "set [--user NAME | --defaults] [--vms N --vcpus N --mem-mb N --disk-gb N --exposures N --streams N]",
		Short: "Admins: set a user's limits, or the defaults (\"default\" makes a limit follow the default again)",
		Args:  NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req, err := quotaSetRequest(cmd.Flags(), values)
			if err != nil {
				return err
			}
			req.UserName, req.Defaults = user, defaults
			c, err := a.dial()
			if err != nil {
				return err
			}
			r, err := c.quota.SetQuota(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) {
				if r.Msg.Quota != nil {
					quotaTable(w, r.Msg.Quota)
					return
				}
				defaultsTable(w, r.Msg.Defaults)
			})
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&user, "user", "", "the user (default: you)")
	fs.BoolVar(&defaults, "defaults", false, "change the defaults every user without a limit of its own follows")
	for i, l := range quotaLimits {
		fs.StringVar(&values[i], l.flag, "", "the limit, or \"default\" to follow the default")
	}
	return cmd
}

// quotaSetRequest turns the limit flags given into a request: a number
// sets a limit, "default" unsets it.
func quotaSetRequest(fs *pflag.FlagSet, values []string) (*eitriv1.SetQuotaRequest, error) {
	req := &eitriv1.SetQuotaRequest{Limits: &eitriv1.QuotaLimits{}}
	ptrs := limitPtrs(req.Limits)
	for i, l := range quotaLimits {
		switch v := values[i]; {
		case !flagGiven(fs, l.flag):
		case v == "default":
			req.Unset = append(req.Unset, l.name)
		default:
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				return nil, Usagef("--%s %q: want a number of 0 or more, or \"default\"", l.flag, v)
			}
			*ptrs[i] = &n
		}
	}
	if len(req.Unset) == 0 && noLimits(req.Limits) {
		return nil, Usagef("eitri quota set needs at least one limit (--vms, --vcpus, --mem-mb, --disk-gb, --exposures, --streams)")
	}
	return req, nil
}

// noLimits reports whether no limit is set in l.
func noLimits(l *eitriv1.QuotaLimits) bool {
	for _, p := range limitPtrs(l) {
		if *p != nil {
			return false
		}
	}
	return true
}

func quotaTable(w io.Writer, q *eitriv1.Quota) {
	fmt.Fprintf(w, "quota of %s\n", q.GetUserName())
	fmt.Fprintln(w, "LIMIT\tUSED\tOF\tFROM")
	used := usageOf(q.GetUsage())
	eff, own := q.GetEffective(), q.GetOwn()
	if eff == nil {
		eff = &eitriv1.QuotaLimits{}
	}
	if own == nil {
		own = &eitriv1.QuotaLimits{}
	}
	effs, owns := limitPtrs(eff), limitPtrs(own)
	for i, l := range quotaLimits {
		from := "default"
		if *owns[i] != nil {
			from = "own"
		}
		fmt.Fprintf(w, "%s\t%d\t%s\t%s\n", l.flag, used[i], limitText(*effs[i]), from)
	}
}

func defaultsTable(w io.Writer, d *eitriv1.QuotaLimits) {
	if d == nil {
		d = &eitriv1.QuotaLimits{}
	}
	fmt.Fprintln(w, "DEFAULT\tLIMIT")
	for i, l := range quotaLimits {
		fmt.Fprintf(w, "%s\t%s\n", l.flag, limitText(*limitPtrs(d)[i]))
	}
}

func limitText(v *int64) string {
	if v == nil {
		return "—"
	}
	return strconv.FormatInt(*v, 10)
}
