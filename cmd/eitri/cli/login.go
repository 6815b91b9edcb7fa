package cli

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/connclient"
)

func newLoginCmd(a *app) *cobra.Command {
	var token, fingerprint string
	cmd := &cobra.Command{
		Use:   "login URL[,URL...]",
		Short: "Save a control plane's URL, your token and its certificate's fingerprint",
		Long: `Save a control plane's URL and your token in your config dir (mode 0600),
so later commands need no EITRI_URL and EITRI_TOKEN (which still override it).

The token comes from --token, EITRI_TOKEN, or is asked for on stdin. For
https, the control plane's certificate is pinned by its SHA-256 fingerprint,
as agents pin it: give it with --fingerprint (the server logs it at start),
or check the one shown and confirm it. A certificate your system's CAs
trust is checked the ordinary way and not pinned.

A control plane with several replicas is given as every replica's URL,
comma-separated: each must present the same
certificate, and later commands fail over between them.`,
		Example: `  eitri login http://127.0.0.1:8080 --token "$(cat .data/dev/control/admin.token)"
  eitri login https://cp.example:7443 --fingerprint 3f0c…
  eitri login https://cp1.example:7443,https://cp2.example:7443 --fingerprint 3f0c…`,
		Args: needArgs("a URL (http://HOST:PORT or https://HOST:PORT)"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.login(cmd.Context(), args[0], token, fingerprint)
		},
	}
	cmd.Flags().StringVar(&token, "token", "", "your token (default: EITRI_TOKEN, else asked for)")
	cmd.Flags().StringVar(&fingerprint, "fingerprint", "", "the control plane's certificate SHA-256, hex (https; default: EITRI_FINGERPRINT, else shown to confirm)")
	return cmd
}

func (a *app) login(ctx context.Context, rawURL, token, fingerprint string) error {
	ep, err := parseURLs(rawURL)
	if err != nil {
		return UsageError{error: err}
	}
	u := ep.URL
	ep.Token, ep.Fingerprint = token, strings.ToLower(fingerprint)
	if ep.Token == "" {
		ep.Token = os.Getenv("EITRI_TOKEN")
	}
	if ep.Fingerprint == "" {
		ep.Fingerprint = strings.ToLower(os.Getenv("EITRI_FINGERPRINT"))
	}
	in := bufio.NewReader(a.io.In)
	if strings.HasPrefix(u, "https://") {
		if ep.Fingerprint, err = a.pin(ctx, u, ep.Fingerprint, in); err != nil {
			return err
		}
		if err := a.sameCertificate(ctx, ep); err != nil {
			return err
		}
	} else if !loopbackURL(u) {
		fmt.Fprintf(a.io.Err, "warning: %s is plain http: the token crosses the network readable by anyone on the path\n", u)
	}
	if ep.Token == "" {
		if ep.Token, err = a.askToken(u, in); err != nil {
			return err
		}
	}
	// The token is tried before it is saved: a typo is caught now, not at
	// the next command.
	r, err := a.clientFor(ep).quota.GetQuota(ctx, connect.NewRequest(&eitriv1.GetQuotaRequest{}))
	if err != nil {
		return fmt.Errorf("%s did not accept the token (nothing saved): %w", u, apiError(err))
	}
	path, err := saveLogin(ep)
	if err != nil {
		return err
	}
	fmt.Fprintf(a.io.Out, "logged in to %s as %s (saved in %s)\n", strings.Join(ep.urls(), ", "), r.Msg.GetQuota().GetUserName(), path)
	return nil
}

// pin decides the fingerprint to save for an https control plane: the one
// given, if the server presents it; none when the system's CAs vouch for
// the certificate; else the presented one, once a person has confirmed it.
func (a *app) pin(ctx context.Context, u, given string, in *bufio.Reader) (string, error) {
	leaf, trusted, err := presentedCert(ctx, u)
	if err != nil {
		return "", err
	}
	got := connclient.Fingerprint(leaf.Raw)
	switch {
	case given != "":
		if given != got {
			return "", fmt.Errorf("%s presents a certificate with fingerprint %s, not the %s given: wrong server, or its certificate changed (nothing saved)", u, got, given)
		}
		return got, nil
	case trusted:
		return "", nil
	}
	notice := fmt.Sprintf("%s presents a certificate no CA on this machine vouches for.\nIts SHA-256 fingerprint is %s\n(the control plane logs its fingerprint at start; join tokens carry it too).\n", u, got)
	if !isTerminal(a.io.In) {
		return "", fmt.Errorf("%spass --fingerprint %s once you have checked it (nothing saved)", notice, got)
	}
	fmt.Fprint(a.io.Err, notice, "Trust it and pin it? [y/N] ")
	answer, _ := in.ReadString('\n')
	if a := strings.ToLower(strings.TrimSpace(answer)); a != "y" && a != "yes" {
		return "", errors.New("certificate not trusted; nothing saved")
	}
	return got, nil
}

// sameCertificate checks that every other replica presents the certificate
// the first one does (replicas share one serving identity), so the pin (or
// the CAs' word) holds wherever a request fails over to. A replica that
// cannot be reached now is only warned about: it may be down for an upgrade.
func (a *app) sameCertificate(ctx context.Context, ep endpoint) error {
	for _, u := range ep.urls()[1:] {
		leaf, trusted, err := presentedCert(ctx, u)
		if err != nil {
			fmt.Fprintf(a.io.Err, "warning: %v; its certificate is checked when a request reaches it\n", err)
			continue
		}
		if got := connclient.Fingerprint(leaf.Raw); ep.Fingerprint != "" && got != ep.Fingerprint {
			return fmt.Errorf("%s presents a certificate with fingerprint %s, not the %s of %s: replicas must share one certificate (nothing saved)", u, got, ep.Fingerprint, ep.URL)
		} else if ep.Fingerprint == "" && !trusted {
			return fmt.Errorf("%s presents a certificate no CA on this machine vouches for, unlike %s (nothing saved)", u, ep.URL)
		}
	}
	return nil
}

// presentedCert is the certificate the server at u presents, and whether
// the system's CAs vouch for it under u's host name. Nothing but the
// handshake is sent.
func presentedCert(ctx context.Context, u string) (*x509.Certificate, bool, error) {
	pu, err := url.Parse(u)
	if err != nil {
		return nil, false, err
	}
	addr := pu.Host
	if pu.Port() == "" {
		addr = net.JoinHostPort(pu.Hostname(), "443")
	}
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	d := tls.Dialer{Config: &tls.Config{
		ServerName: pu.Hostname(), MinVersion: tls.VersionTLS12,
		InsecureSkipVerify: true, // only to read the certificate; it is checked below
	}}
	conn, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, false, fmt.Errorf("cannot reach %s: %w", u, err)
	}
	defer conn.Close()
	certs := conn.(*tls.Conn).ConnectionState().PeerCertificates
	if len(certs) == 0 {
		return nil, false, fmt.Errorf("%s presented no certificate", u)
	}
	inter := x509.NewCertPool()
	for _, c := range certs[1:] {
		inter.AddCert(c)
	}
	_, verr := certs[0].Verify(x509.VerifyOptions{DNSName: pu.Hostname(), Intermediates: inter})
	return certs[0], verr == nil, nil
}

// askToken reads the token: without echo from a terminal, else the first
// line of stdin (eitri login URL < token-file).
func (a *app) askToken(u string, in *bufio.Reader) (string, error) {
	var tok string
	if f, ok := a.io.In.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		fmt.Fprintf(a.io.Err, "Token for %s: ", u)
		b, err := term.ReadPassword(int(f.Fd()))
		fmt.Fprintln(a.io.Err)
		if err != nil {
			return "", err
		}
		tok = string(b)
	} else {
		line, err := in.ReadString('\n')
		if err != nil && line == "" {
			return "", errors.New("no token: give --token, set EITRI_TOKEN, or write it to stdin")
		}
		tok = line
	}
	tok = strings.TrimSpace(tok)
	if tok == "" {
		return "", errors.New("no token: give --token, set EITRI_TOKEN, or write it to stdin")
	}
	return tok, nil
}

// loopbackURL says whether u's host is this machine, where plain http
// exposes the token to nobody else.
func loopbackURL(u string) bool {
	pu, err := url.Parse(u)
	if err != nil {
		return false
	}
	if pu.Hostname() == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(pu.Hostname())
	return err == nil && ip.IsLoopback()
}

func newLogoutCmd(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "logout",
		Short: "Forget the saved control plane and token",
		Long: `Forget the saved control plane and token (the file eitri login wrote).
The token itself stays valid: revoke it with 'eitri token revoke ID'.`,
		Args: NoArgs,
		RunE: func(*cobra.Command, []string) error {
			path, err := configPath()
			if err != nil {
				return err
			}
			saved, _, _, _ := loadLogin() // only for the message; a broken file is removed all the same
			if err := os.Remove(path); errors.Is(err, fs.ErrNotExist) {
				fmt.Fprintln(a.io.Out, "not logged in")
				return nil
			} else if err != nil {
				return err
			}
			if saved.URL != "" {
				fmt.Fprintf(a.io.Out, "logged out of %s (removed %s)\n", saved.URL, path)
			} else {
				fmt.Fprintf(a.io.Out, "removed %s\n", path)
			}
			return nil
		},
	}
}
