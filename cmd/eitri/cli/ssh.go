package cli

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/crypto/ssh"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/sshcert"
)

func newSSHCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "ssh NAME|ID [-- SSH-ARGS...]",
		Short: "Log into a VM with the system ssh, through a tunnel, its host key pinned",
		Long: "Runs ssh as the VM's login user, connected through `eitri tunnel` (nothing is published).\n" +
			"The guest's host key, as its host reported it, is written to a known_hosts file eitri owns\n" +
			"(in eitri's config dir) and checked strictly: a key that differs is refused, and none is\n" +
			"ever trusted on first use; the control plane's host CA is trusted beside it, for eitri's\n" +
			"aliases (eitri-<vm id>, the name ssh connects to) only. ssh logs in with a key made for\n" +
			"this login and a 5-minute certificate for it from the control plane, both removed when\n" +
			"ssh exits. Arguments after -- go to ssh after the destination (options, then a command).",
		Args:              cobra.MinimumNArgs(1),
		ValidArgsFunction: a.completeVMs,
		RunE: func(cmd *cobra.Command, args []string) error {
			extra := args[1:]
			if at := cmd.ArgsLenAtDash(); at < 0 && len(extra) > 0 {
				return Usagef("%s: put ssh's arguments after --, got %q", cmd.CommandPath(), extra[0])
			} else if at > 1 {
				return Usagef("%s takes one VM, got %q", cmd.CommandPath(), args[1])
			}
			return a.onVM(func(ctx context.Context, c *client, id string) error {
				target, err := c.sshTarget(ctx, id, extra)
				if err != nil {
					return err
				}
				// A certificate for a few minutes, for a key made for this
				// login only. Without one (an older control plane, a guest
				// seeded before the CA) ssh still offers the user's own keys.
				login, err := c.newSSHLogin(ctx, "", target.VMID, 0)
				if err != nil {
					fmt.Fprintf(a.io.Err, "eitri: no SSH certificate (%v); ssh offers your own keys\n", err)
				} else {
					defer login.Remove()
					target.Login = login
				}
				ssh := exec.CommandContext(ctx, "ssh", SSHArgs(target)...)
				ssh.Stdin, ssh.Stdout, ssh.Stderr = a.io.In, a.io.Out, a.io.Err
				return ssh.Run()
			})(cmd, args)
		},
	}
}

// SSHTarget is what an ssh command line for a VM is made of. eitri ssh is
// built from SSHTarget, SSHArgs, SSHLogin and the known_hosts pins; they
// are exported so the end-to-end tests in cmd/eitri, which run a real
// control plane and sshd, can drive each.
type SSHTarget struct {
	// Self is this eitri binary, which ssh runs as its ProxyCommand.
	Self string
	VMID string
	User string
	// KnownHosts is eitri's known_hosts file, holding the guest's key
	// under HostAlias.
	KnownHosts string
	// Extra is the caller's ssh arguments, after the destination.
	Extra []string
	// Login is a short-lived certificate and its key; nil: none.
	Login *SSHLogin
}

// HostAlias names the VM's host key in KnownHosts (and is ssh's
// destination, so no ssh_config Host block for a VM name applies). The
// guest's host certificate names it, and the host CA is trusted for it.
func (t SSHTarget) HostAlias() string { return sshcert.HostAlias(t.VMID) }

// SSHArgs is the ssh command line for t. Options given with -o first win,
// so these cannot be overridden by the caller's.
func SSHArgs(t SSHTarget) []string {
	proxy := ShellQuote(t.Self) + " tunnel " + ShellQuote(t.VMID) + " 22"
	args := []string{
		// ssh expands %-tokens in ProxyCommand.
		"-o", "ProxyCommand=" + strings.ReplaceAll(proxy, "%", "%%"),
		"-o", "HostKeyAlias=" + t.HostAlias(),
		"-o", "UserKnownHostsFile=" + t.KnownHosts,
		"-o", "GlobalKnownHostsFile=/dev/null",
		"-o", "StrictHostKeyChecking=yes",
		// The file is eitri's: ssh adds nothing to it.
		"-o", "UpdateHostKeys=no",
		"-o", "CheckHostIP=no",
	}
	if t.Login != nil {
		// Offered first; the user's own keys (agent, ~/.ssh) follow.
		args = append(args, "-i", t.Login.IdentityFile, "-o", "CertificateFile="+t.Login.CertificateFile)
	}
	if t.User != "" {
		args = append(args, "-l", t.User)
	}
	args = append(args, t.HostAlias())
	return append(args, t.Extra...)
}

// sshTarget looks the VM up and pins its host key in eitri's known_hosts.
func (c *client) sshTarget(ctx context.Context, id string, extra []string) (SSHTarget, error) {
	r, err := c.vm.GetVM(ctx, connect.NewRequest(&eitriv1.GetVMRequest{Id: id}))
	if err != nil {
		return SSHTarget{}, apiError(err)
	}
	vm := r.Msg.GetVm()
	if vm.GetSshHostPubkey() == "" {
		return SSHTarget{}, fmt.Errorf("%s has not reported its SSH host key yet (wait until it is ready: eitri vm wait %s)", vm.GetName(), vm.GetName())
	}
	self, err := c.self()
	if err != nil {
		return SSHTarget{}, fmt.Errorf("cannot find this eitri binary for ssh's ProxyCommand: %w", err)
	}
	path, err := KnownHostsPath()
	if err != nil {
		return SSHTarget{}, err
	}
	t := SSHTarget{Self: self, VMID: vm.GetId(), User: vm.GetLoginUser(), KnownHosts: path, Extra: extra}
	if err := PinHostKey(path, t.HostAlias(), vm.GetSshHostPubkey()); err != nil {
		return SSHTarget{}, err
	}
	// The host CA too: a guest presenting a host certificate is checked
	// against it (the certificate names the alias), a guest without one,
	// or with an expired one, against the pinned key.
	if cas, err := c.ssh.GetSSHCAKeys(ctx, connect.NewRequest(&eitriv1.GetSSHCAKeysRequest{})); err == nil {
		if err := PinHostCAs(path, cas.Msg.GetHostCaKeys()); err != nil {
			return SSHTarget{}, err
		}
	}
	return t, nil
}

// KnownHostsPath is eitri's known_hosts, beside its login.
func KnownHostsPath() (string, error) {
	cfg, err := configPath()
	if err != nil {
		return "", err
	}
	return filepath.Join(filepath.Dir(cfg), "known_hosts"), nil
}

// PinHostCAs makes keys the only @cert-authority lines in path.
func PinHostCAs(path string, keys []*eitriv1.SSHCAKey) error {
	add, err := hostCALines(keys)
	if err != nil {
		return err
	}
	return RewriteKnownHosts(path, func(f []string) bool { return f[0] == "@cert-authority" }, add)
}

// hostCALines are the known_hosts lines trusting keys for eitri's aliases
// only (sshcert.HostAliasPattern). Made here from the keys, not taken
// from the control plane's known_hosts lines: an older one sends "*",
// which would trust its host CA for every host ssh connects to.
func hostCALines(keys []*eitriv1.SSHCAKey) ([]string, error) {
	var out []string
	for _, k := range keys {
		key, _, _, _, err := ssh.ParseAuthorizedKey([]byte(k.GetPublicKey()))
		if err != nil {
			return nil, fmt.Errorf("the control plane's host CA key is not a key: %w", err)
		}
		out = append(out, "@cert-authority "+sshcert.HostAliasPattern+" "+strings.TrimSpace(string(ssh.MarshalAuthorizedKey(key))))
	}
	return out, nil
}

// PinHostKey makes the key the only one in path for alias, keeping the
// other aliases' lines. The key is parsed and written in its canonical
// form, so nothing but a key reaches the file.
func PinHostKey(path, alias, authorizedKey string) error {
	key, _, _, _, err := ssh.ParseAuthorizedKey([]byte(authorizedKey))
	if err != nil {
		return fmt.Errorf("the VM's reported SSH host key is not a key: %w", err)
	}
	line := alias + " " + strings.TrimSpace(string(ssh.MarshalAuthorizedKey(key)))
	return RewriteKnownHosts(path, func(f []string) bool { return f[0] == alias }, []string{line})
}

// RewriteKnownHosts replaces the lines of path that drop says (given a
// line's fields) with add, keeping the others, atomically.
func RewriteKnownHosts(path string, drop func(fields []string) bool, add []string) error {
	old, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		return err
	}
	var lines []string
	for _, l := range strings.Split(string(old), "\n") {
		if f := strings.Fields(l); len(f) == 0 || drop(f) {
			continue
		}
		lines = append(lines, l)
	}
	lines = append(lines, add...)
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".known_hosts-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(strings.Join(lines, "\n") + "\n"); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}
