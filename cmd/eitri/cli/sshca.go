package cli

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/types/known/durationpb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func newSSHCACmd(a *app) *cobra.Command {
	var knownHosts bool
	cmd := &cobra.Command{
		Use:   "ssh-ca",
		Short: "Print the control plane's SSH CA keys (--known-hosts: the line that trusts every eitri guest)",
		Long: `Print the control plane's SSH certificate authorities.

Guests trust certificates from the user CA (eitri ssh gets one for a few
minutes), and present host certificates from the host CA, for 30 days at a
time and renewed, naming the VM's id and its alias eitri-<vm id>. One
known_hosts line trusts every eitri guest's host key under its alias, and
the host CA for no other name:

  eitri ssh-ca --known-hosts >> ~/.ssh/known_hosts
  ssh -o HostKeyAlias=eitri-<vm id> -o ProxyCommand='eitri tunnel <vm id> 22' eitri@<vm id>

After a CA rotation the previous key is listed too, marked "previous".`,
		Args: NoArgs,
		RunE: a.withClient(func(ctx context.Context, c *client) error {
			r, err := c.ssh.GetSSHCAKeys(ctx, connect.NewRequest(&eitriv1.GetSSHCAKeysRequest{}))
			if err != nil {
				return apiError(err)
			}
			if knownHosts {
				lines, err := hostCALines(r.Msg.GetHostCaKeys())
				if err != nil {
					return err
				}
				for _, l := range lines {
					fmt.Fprintln(c.out, l)
				}
				return nil
			}
			return c.show(r.Msg, func(w io.Writer) { sshCATable(w, r.Msg) })
		}),
	}
	cmd.Flags().BoolVar(&knownHosts, "known-hosts", false, "print only the @cert-authority known_hosts lines")
	cmd.AddCommand(newSSHCARotateCmd(a))
	a.addOutputFlag(cmd)
	return cmd
}

func newSSHCARotateCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "rotate user|host",
		Short: "Admins: replace a CA's key (the old one stays trusted until the next rotation)",
		Long: `Replace the user or the host CA's key. Certificates are signed by the new
key from now on; the old key stays trusted (listed as previous, and seeded
into new guests) until that CA is rotated again.

Guests read their seed once, on their first boot: a guest created before a
user CA rotation accepts no certificate from the new key (its injected key
still works). After a host CA rotation, add the new known_hosts line
(eitri ssh-ca --known-hosts); guests keep presenting certificates from the
old key until their agents renew them (within 10 days).`,
		Args:      cobra.ExactArgs(1),
		ValidArgs: []cobra.Completion{"user", "host"},
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := a.dial()
			if err != nil {
				return err
			}
			r, err := c.ssh.RotateSSHCA(cmd.Context(), connect.NewRequest(&eitriv1.RotateSSHCARequest{Ca: args[0]}))
			if err != nil {
				return apiError(err)
			}
			return c.show(r.Msg, func(w io.Writer) { sshCATable(w, r.Msg.GetKeys()) })
		},
	}
}

func sshCATable(w io.Writer, m *eitriv1.GetSSHCAKeysResponse) {
	section := func(title string, keys []*eitriv1.SSHCAKey) {
		fmt.Fprintln(w, title)
		for _, k := range keys {
			which := "current"
			if k.GetPrevious() {
				which = "previous"
			}
			fmt.Fprintf(w, "  %s\t%s\t%s\n", which, k.GetFingerprint(), k.GetPublicKey())
		}
	}
	section("user CA (guests accept the certificates it signs):", m.GetUserCaKeys())
	section("host CA (guests' host keys are certified by it):", m.GetHostCaKeys())
	fmt.Fprintln(w, "known_hosts (trusts every eitri guest, under its alias eitri-<vm id>):")
	lines, _ := hostCALines(m.GetHostCaKeys()) // a key that is not one shows no line
	for _, l := range lines {
		fmt.Fprintln(w, "  "+l)
	}
}

// SSHLogin is an ephemeral key pair with a short-lived certificate for
// logging into one VM, and a known_hosts file trusting the host CA for
// eitri's aliases, in a private temporary directory. Remove deletes it all.
type SSHLogin struct {
	Dir string
	// IdentityFile is the private key (ssh -i); CertificateFile its
	// certificate (ssh -o CertificateFile=).
	IdentityFile, CertificateFile string
	// KnownHostsFile holds "@cert-authority eitri-* <host CA>" lines
	// (ssh -o UserKnownHostsFile=).
	KnownHostsFile string
	// User is the VM's login user, whom the certificate logs in as.
	User        string
	ValidBefore time.Time
}

// newSSHLogin makes an ed25519 key in a new 0700 directory under dir (""
// for the system's temporary directory), has the control plane certify it
// for vmID for ttl (0: the server's default), and writes the host CA's
// known_hosts lines beside it. eitri ssh calls it.
func (c *client) newSSHLogin(ctx context.Context, dir, vmID string, ttl time.Duration) (*SSHLogin, error) {
	d, err := os.MkdirTemp(dir, "eitri-ssh-")
	if err != nil {
		return nil, err
	}
	l := &SSHLogin{Dir: d}
	ok := false
	defer func() {
		if !ok {
			l.Remove()
		}
	}()
	if err := os.Chmod(d, 0o700); err != nil {
		return nil, err
	}
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		return nil, err
	}
	block, err := ssh.MarshalPrivateKey(priv, "eitri ssh "+vmID)
	if err != nil {
		return nil, err
	}
	sshPub, err := ssh.NewPublicKey(pub)
	if err != nil {
		return nil, err
	}
	req := &eitriv1.SignUserKeyRequest{VmId: vmID, PublicKey: string(bytes.TrimSpace(ssh.MarshalAuthorizedKey(sshPub)))}
	if ttl > 0 {
		req.Ttl = durationpb.New(ttl)
	}
	signed, err := c.ssh.SignUserKey(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, apiError(err)
	}
	cas, err := c.ssh.GetSSHCAKeys(ctx, connect.NewRequest(&eitriv1.GetSSHCAKeysRequest{}))
	if err != nil {
		return nil, apiError(err)
	}
	caLines, err := hostCALines(cas.Msg.GetHostCaKeys())
	if err != nil {
		return nil, err
	}
	l.IdentityFile = filepath.Join(d, "id_ed25519")
	l.CertificateFile = l.IdentityFile + "-cert.pub"
	l.KnownHostsFile = filepath.Join(d, "known_hosts")
	for _, f := range []struct {
		path string
		data []byte
	}{
		{l.IdentityFile, pem.EncodeToMemory(block)},
		{l.IdentityFile + ".pub", ssh.MarshalAuthorizedKey(sshPub)},
		{l.CertificateFile, []byte(signed.Msg.GetCertificate() + "\n")},
		{l.KnownHostsFile, []byte(strings.Join(caLines, "\n") + "\n")},
	} {
		if err := os.WriteFile(f.path, f.data, 0o600); err != nil {
			return nil, err
		}
	}
	l.User = signed.Msg.GetLoginUser()
	l.ValidBefore = signed.Msg.GetValidBefore().AsTime()
	ok = true
	return l, nil
}

// NewSSHLogin is newSSHLogin against the control plane the saved login and
// the environment name, as any client command is.
func NewSSHLogin(ctx context.Context, dir, vmID string, ttl time.Duration) (*SSHLogin, error) {
	c, err := (&app{format: formatTable}).dial()
	if err != nil {
		return nil, err
	}
	return c.newSSHLogin(ctx, dir, vmID, ttl)
}

// SSHOptions are the system ssh's options that log in with l: the key and
// its certificate only (not the user's agent's keys), as l.User, trusting
// the host CA for hostAlias, which must be the VM's alias
// (sshcert.HostAlias): the only name both the certificate and the
// known_hosts line cover.
func (l *SSHLogin) SSHOptions(hostAlias string) []string {
	return []string{
		"-i", l.IdentityFile,
		"-o", "CertificateFile=" + l.CertificateFile,
		"-o", "IdentitiesOnly=yes",
		"-o", "UserKnownHostsFile=" + l.KnownHostsFile,
		"-o", "StrictHostKeyChecking=yes",
		"-o", "HostKeyAlias=" + hostAlias,
		"-l", l.User,
	}
}

// Remove deletes the key, the certificate and the directory.
func (l *SSHLogin) Remove() error { return os.RemoveAll(l.Dir) }
