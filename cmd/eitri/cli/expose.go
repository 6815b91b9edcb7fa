package cli

import (
	"fmt"
	"io"
	"strconv"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func newExposeCmd(a *app) *cobra.Command {
	cmd := noun("expose", "Publish a VM's ports on its host",
		newExposeCreateCmd(a), newExposeListCmd(a), newExposeRmCmd(a))
	a.addOutputFlag(cmd)
	return cmd
}

func newExposeCreateCmd(a *app) *cobra.Command {
	var hostPort, maxSessions uint32
	var udp, local bool
	cmd := &cobra.Command{
		Use:               "create VM GUEST_PORT",
		Short:             "Publish a guest port on the VM's host",
		Args:              needArgs("a VM name or id", "a guest port"),
		ValidArgsFunction: a.completeVMs,
		RunE: func(cmd *cobra.Command, args []string) error {
			gp, err := strconv.ParseUint(args[1], 10, 32)
			if err != nil {
				return Usagef("guest port %q is not a number", args[1])
			}
			c, err := a.dial()
			if err != nil {
				return err
			}
			vmID, err := c.vmID(cmd.Context(), args[0])
			if err != nil {
				return err
			}
			proto, scope := "tcp", "lan"
			if udp {
				proto = "udp"
			}
			if local {
				scope = "local"
			}
			r, err := c.exp.CreateExposure(cmd.Context(), connect.NewRequest(&eitriv1.CreateExposureRequest{
				VmId: vmID, GuestPort: uint32(gp), HostPort: hostPort, Protocol: proto, Scope: scope, MaxSessions: maxSessions,
			}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { exposureTable(w, r.Msg.Exposure) })
		},
	}
	fs := cmd.Flags()
	fs.Uint32Var(&hostPort, "host-port", 0, "host port (default: allocated)")
	fs.BoolVar(&udp, "udp", false, "UDP instead of TCP")
	fs.BoolVar(&local, "local", false, "listen on the host's loopback only")
	fs.Uint32Var(&maxSessions, "max", 0, "cap on concurrent connections/sessions")
	return cmd
}

func newExposeListCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:               "ls [VM]",
		Aliases:           []string{"list"},
		Short:             "List published ports, of one VM or all",
		Args:              optionalArgs(0, "a VM name or id"),
		ValidArgsFunction: a.completeVMs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			req := &eitriv1.ListExposuresRequest{}
			if len(args) > 0 {
				if req.VmId, err = c.vmID(cmd.Context(), args[0]); err != nil {
					return err
				}
			}
			r, err := c.exp.ListExposures(cmd.Context(), connect.NewRequest(req))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { exposureTable(w, r.Msg.Exposures...) })
		},
	}
}

func newExposeRmCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:     "rm ID",
		Aliases: []string{"delete"},
		Short:   "Stop publishing a port",
		Args:    needArgs("an exposure id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			if _, err := c.exp.DeleteExposure(cmd.Context(), connect.NewRequest(&eitriv1.DeleteExposureRequest{Id: args[0]})); err != nil {
				return apiError(err)
			}
			fmt.Fprintln(c.out, "removed", args[0])
			return nil
		},
	}
}
