package cli

import (
	"fmt"
	"io"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func newHostImagesCmd(a *app) *cobra.Command {
	var prune bool
	cmd := &cobra.Command{
		Use:   "images NAME|ID",
		Short: "Admins: what a host's image cache holds, or --prune what nothing wants",
		Long: `List the images in a host's cache: digest, size, last use, whether it is
pinned (and by the pull of which catalogue image), the VMs on the host made
from it, and the catalogue names and versions for its digest.

With --prune the host removes every image that is not pinned and that no VM
on it was made from, and says what it removed and the space freed.`,
		Args: needArgs("a host name or id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			id, err := c.hostID(ctx, args[0])
			if err != nil {
				return err
			}
			if prune {
				r, err := c.host.PruneHostImages(ctx, connect.NewRequest(&eitriv1.PruneHostImagesRequest{Id: id}))
				if err != nil {
					return apiError(err)
				}
				return c.show(r.Msg, func(w io.Writer) {
					if len(r.Msg.Removed) == 0 {
						fmt.Fprintf(w, "nothing to prune on %s: every cached image is pinned or backs a VM\n", args[0])
						return
					}
					fmt.Fprintf(w, "removed %d image(s) from %s, freeing %s:\n", len(r.Msg.Removed), args[0], humanBytes(float64(r.Msg.FreedBytes)))
					hostImageTable(w, r.Msg.Removed)
				})
			}
			r, err := c.host.ListHostImages(ctx, connect.NewRequest(&eitriv1.ListHostImagesRequest{Id: id}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) {
				if r.Msg.ReportedAt == nil {
					fmt.Fprintf(w, "%s has not reported its image cache (it is not connected, or its agent predates the report)\n", args[0])
					return
				}
				hostImageTable(w, r.Msg.Images)
				n := len(r.Msg.Images) + int(r.Msg.More)
				fmt.Fprintf(w, "\n%d image(s), %s", n, humanBytes(float64(r.Msg.TotalBytes)))
				if r.Msg.More > 0 {
					fmt.Fprintf(w, "; %d not listed", r.Msg.More)
				}
				fmt.Fprintf(w, " (as of %s)\n", whenPB(r.Msg.ReportedAt, "—"))
			})
		},
	}
	cmd.Flags().BoolVar(&prune, "prune", false, "remove what nothing wants (not pinned, backing no VM) and say what went")
	return cmd
}

func hostImageTable(w io.Writer, rows []*eitriv1.HostImage) {
	fmt.Fprintln(w, "SHA256\tSIZE\tLAST USED\tPINNED\tVMS\tCATALOGUE")
	for _, im := range rows {
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", short(im.Sha256), humanBytes(float64(im.SizeBytes)),
			whenPB(im.LastUsed, "—"), pinnedBy(im), dash(imageVMs(im)), dash(catalogueNames(im.Catalogue)))
	}
}

func pinnedBy(im *eitriv1.HostImage) string {
	switch {
	case !im.Pinned:
		return "no"
	case len(im.PulledFor) > 0:
		return "pull of " + strings.Join(im.PulledFor, ", ")
	default:
		return "yes (in use)"
	}
}

func imageVMs(im *eitriv1.HostImage) string {
	var names []string
	for _, v := range im.Vms {
		names = append(names, cmpOr(v.Name, v.Id))
	}
	if im.MoreVms > 0 {
		names = append(names, fmt.Sprintf("+%d more", im.MoreVms))
	}
	return strings.Join(names, ", ")
}

func catalogueNames(cs []*eitriv1.CatalogueVersion) string {
	var out []string
	for _, c := range cs {
		s := fmt.Sprintf("%s v%d", c.Name, c.Version)
		if c.Current {
			s += " (current)"
		}
		out = append(out, s)
	}
	return strings.Join(out, ", ")
}
