package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strconv"

	"connectrpc.com/connect"

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

// cmdQuota runs eitri quota get|set. It has flags of its own: --vcpus and
// friends mean limits here, not a VM's size.
func cmdQuota(ctx context.Context, verb string, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("quota "+verb, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	output := fs.String("o", "table", "output: table or json")
	user := fs.String("user", "", "the user (default: you)")
	defaults := fs.Bool("defaults", false, "set: change the defaults every user without a limit of its own follows")
	values := make([]string, len(quotaLimits))
	for i, l := range quotaLimits {
		fs.StringVar(&values[i], l.flag, "", "set: the limit, or \"default\" to follow the default")
	}
	if _, err := parse(fs, args); err != nil {
		return err
	}
	c, err := newClient(out, *output == "json")
	if err != nil {
		return err
	}
	switch verb {
	case "get":
		r, err := c.quota.GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{UserName: *user}))
		if err != nil {
			return apiError(err)
		}
		return c.print(r.Msg, func(w io.Writer) { quotaTable(w, r.Msg.Quota) })
	case "set":
		req, err := quotaSetRequest(fs, values)
		if err != nil {
			return err
		}
		req.UserName, req.Defaults = *user, *defaults
		r, err := c.quota.SetQuota(ctx, connect.NewRequest(req))
		if err != nil {
			return apiError(err)
		}
		return c.print(r.Msg, func(w io.Writer) {
			if r.Msg.Quota != nil {
				quotaTable(w, r.Msg.Quota)
				return
			}
			defaultsTable(w, r.Msg.Defaults)
		})
	}
	return usagef("unknown command: eitri quota %s", verb)
}

// quotaSetRequest turns the limit flags given into a request: a number
// sets a limit, "default" unsets it.
func quotaSetRequest(fs *flag.FlagSet, values []string) (*eitriv1.SetQuotaRequest, error) {
	req := &eitriv1.SetQuotaRequest{Limits: &eitriv1.QuotaLimits{}}
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	ptrs := limitPtrs(req.Limits)
	for i, l := range quotaLimits {
		switch v := values[i]; {
		case !given[l.flag]:
		case v == "default":
			req.Unset = append(req.Unset, l.name)
		default:
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 0 {
				return nil, usagef("--%s %q: want a number of 0 or more, or \"default\"", l.flag, v)
			}
			*ptrs[i] = &n
		}
	}
	if len(req.Unset) == 0 && noLimits(req.Limits) {
		return nil, usagef("eitri quota set needs at least one limit (--vms, --vcpus, --mem-mb, --disk-gb, --exposures, --streams)")
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
