package cli

import (
	"context"
	"fmt"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// notAnID says whether an error from a Get by id means "no such id here"
// (not found, or not even shaped like an id), so the argument may be a
// name instead.
func notAnID(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeNotFound, connect.CodeInvalidArgument:
		return true
	}
	return false
}

// vmID resolves what a person typed, a VM's id or its name, to its id. An
// id wins over a name. A name is looked up among the VMs the caller sees;
// one that several share (an admin sees every owner's) is refused with
// their ids.
func (c *client) vmID(ctx context.Context, arg string) (string, error) {
	_, err := c.vm.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: arg}))
	if err == nil {
		return arg, nil
	}
	if !notAnID(err) {
		return "", apiError(err)
	}
	list, err := c.vm.ListVMs(ctx, connect.NewRequest(&eitriv1.ListVMsRequest{}))
	if err != nil {
		return "", apiError(err)
	}
	var named []*eitriv1.VM
	for _, v := range list.Msg.Vms {
		if v.Name == arg {
			named = append(named, v)
		}
	}
	switch len(named) {
	case 0:
		return "", fmt.Errorf("no VM has the id or name %q", arg)
	case 1:
		return named[0].Id, nil
	}
	ids := make([]string, len(named))
	for i, v := range named {
		ids[i] = v.Id + " (owner " + v.OwnerId + ")"
	}
	return "", fmt.Errorf("%d VMs are named %q: %s; give the id", len(ids), arg, strings.Join(ids, ", "))
}

// hostID resolves a host's id or name to its id, as vmID does for VMs.
func (c *client) hostID(ctx context.Context, arg string) (string, error) {
	_, err := c.host.GetHost(ctx, connect.NewRequest(&eitriv1.GetHostRequest{Id: arg}))
	if err == nil {
		return arg, nil
	}
	if !notAnID(err) {
		return "", apiError(err)
	}
	list, err := c.host.ListHosts(ctx, connect.NewRequest(&eitriv1.ListHostsRequest{}))
	if err != nil {
		return "", apiError(err)
	}
	var ids []string
	for _, h := range list.Msg.Hosts {
		if h.Name == arg {
			ids = append(ids, h.Id)
		}
	}
	switch len(ids) {
	case 0:
		return "", fmt.Errorf("no host has the id or name %q", arg)
	case 1:
		return ids[0], nil
	}
	return "", fmt.Errorf("%d hosts are named %q: %s; give the id", len(ids), arg, strings.Join(ids, ", "))
}

// completeVMs offers the caller's VM names to the shell, for commands
// whose first argument is a VM.
func (a *app) completeVMs(_ *cobra.Command, args []string, _ string) ([]cobra.Completion, cobra.ShellCompDirective) {
	if len(args) > 0 {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	c, err := a.dial()
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
	}
	list, err := c.vm.ListVMs(context.Background(), connect.NewRequest(&eitriv1.ListVMsRequest{}))
	if err != nil {
		return nil, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveError
	}
	var out []cobra.Completion
	for _, v := range list.Msg.Vms {
		out = append(out, cobra.CompletionWithDesc(v.Name, v.Lifecycle+" "+v.Id))
	}
	return out, cobra.ShellCompDirectiveNoFileComp
}
