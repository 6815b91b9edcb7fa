package cli

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"google.golang.org/protobuf/types/known/durationpb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func newHostCmd(a *app) *cobra.Command {
	cmd := noun("host", "List, add and retire hosts",
		newHostListCmd(a), newHostGetCmd(a), newHostJoinTokenCmd(a), newHostDecommissionCmd(a), newHostUpgradeCmd(a),
		newHostTopCmd(a), newHostImagesCmd(a))
	a.addOutputFlag(cmd)
	return cmd
}

func newHostListCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "ls",
		Aliases: []string{"list"},
		Short:   "List the hosts",
		Args:    NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.host.ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { hostTable(w, r.Msg.Hosts...) })
		}),
	}
}

func newHostGetCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "get NAME|ID",
		Short: "Show one host",
		Args:  needArgs("a host name or id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			id, err := c.hostID(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			r, err := c.host.GetHost(cmd.Context(), connect.NewRequest(&eitriv1.GetHostRequest{Id: id}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { hostTable(w, r.Msg.Host) })
		},
	}
}

func newHostJoinTokenCmd(a *app) *cobra.Command {
	var ttl time.Duration
	cmd := &cobra.Command{
		Use:   "join-token",
		Short: "Admins: mint a single-use token that enrolls a new host",
		Args:  NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			req := &eitriv1.CreateJoinTokenRequest{}
			if ttl > 0 {
				req.Ttl = durationpb.New(ttl)
			}
			r, err := c.host.CreateJoinToken(ctx, connect.NewRequest(req))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) {
				fmt.Fprintf(w, "Run this on the new host (single use, expires %s):\n\n  %s\n", when(r.Msg.ExpiresAt.AsTime()), r.Msg.Command)
			})
		}),
	}
	cmd.Flags().DurationVar(&ttl, "ttl", 0, "how long the token is good for (default: the server's)")
	return cmd
}

func newHostDecommissionCmd(a *app) *cobra.Command {
	var force bool
	cmd := &cobra.Command{
		Use:   "decommission NAME|ID",
		Short: "Admins: retire a host",
		Long: `Retire a host. It must hold no VMs, unless --force: a host gone for good,
disconnected 10 minutes or more, whose VMs are then marked lost.`,
		Args: needArgs("a host name or id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			id, err := c.hostID(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			r, err := c.host.DecommissionHost(cmd.Context(), connect.NewRequest(&eitriv1.DecommissionHostRequest{Id: id, Force: force}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) {
				if !force {
					fmt.Fprintln(w, "decommissioned", id)
					return
				}
				fmt.Fprintf(w, "decommissioned %s by force\n", id)
				if ids := r.Msg.GetLostVmIds(); len(ids) > 0 {
					fmt.Fprintf(w, "%d VM(s) marked lost (kept to read; eitri vm rm removes them): %s\n", len(ids), strings.Join(ids, " "))
				}
				if ids := r.Msg.GetForgottenVmIds(); len(ids) > 0 {
					fmt.Fprintf(w, "%d deleted VM(s) removed: %s\n", len(ids), strings.Join(ids, " "))
				}
			})
		},
	}
	cmd.Flags().BoolVar(&force, "force", false, "the host is gone for good; its VMs are marked lost")
	return cmd
}
