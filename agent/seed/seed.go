// Package seed writes cloud-init NoCloud seed images: an ISO9660 volume
// labelled "cidata" holding meta-data and user-data, which cloud-init (and the
// project's own test guest) finds on a second disk at boot.
package seed

import (
	"bytes"
	"crypto/ed25519"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"

	"github.com/kdomanski/iso9660"
	"golang.org/x/crypto/ssh"
)

// VolumeID is the label cloud-init's NoCloud datasource looks for.
const VolumeID = "cidata"

// Params is what one guest learns from its seed.
type Params struct {
	// InstanceID changes whenever cloud-init should treat the guest as new.
	InstanceID string
	// Hostname must be a single DNS label.
	Hostname string
	// SSHAuthorizedKey is one authorized_keys line; empty means none.
	SSHAuthorizedKey string
	// HostPrivKey and HostPubKey are the guest's ed25519 SSH host key pair in
	// OpenSSH format. Both or neither: the agent generates them so it can tell
	// users the fingerprint before the guest has even booted.
	HostPrivKey string
	HostPubKey  string
	// LoginUser, when set, is a user the seed creates with passwordless
	// sudo and SSHAuthorizedKey: one name that works on every image, where
	// the images' default users differ (debian, ubuntu, fedora...). The
	// image's default user is kept and gets the key too.
	LoginUser string
	// PhoneHomeURL, when set, is where the guest posts once it has booted:
	// a systemd unit the seed installs does, after cloud-init's final stage,
	// on every boot.
	PhoneHomeURL string
	// TrustedUserCAKeys are SSH CA public keys (authorized_keys form) whose
	// user certificates sshd accepts (TrustedUserCAKeys), beside
	// SSHAuthorizedKey. Empty: none.
	TrustedUserCAKeys []string
	// UserCertPrincipal is the one certificate principal sshd accepts for
	// LoginUser (AuthorizedPrincipalsFile): every guest trusts the same CA,
	// so it names this guest, and a certificate issued for another VM opens
	// nothing here. Required with TrustedUserCAKeys.
	UserCertPrincipal string
	// HostCertificate, when set, is the host CA's certificate for
	// HostPubKey (authorized_keys form), which sshd presents
	// (HostCertificate) so clients trusting the CA need no per-guest key.
	HostCertificate string
	// HostCertURL, when set, is where the guest fetches its current host
	// certificate: certificates are short-lived and the agent renews them,
	// so the seed installs a systemd timer that fetches it a few minutes
	// after every boot and every few hours, installs it if it certifies
	// the guest's own host key, and reloads sshd. Needs HostPubKey.
	HostCertURL string
}

// Where the seed puts the SSH CA material, and the sshd drop-in naming it.
// The certificate's name stays clear of cloud-init's ssh_deletekeys glob
// (/etc/ssh/ssh_host_*key*), which runs after write_files. The drop-in
// needs an sshd_config that includes sshd_config.d (Debian 12, Ubuntu
// 20.04, Fedora and later).
const (
	UserCAKeysPath = "/etc/ssh/eitri_user_ca.pub"
	// PrincipalsDir holds one file per user listing the certificate
	// principals sshd accepts for that user.
	PrincipalsDir       = "/etc/ssh/eitri_principals"
	HostCertificatePath = "/etc/ssh/eitri_host_ed25519_cert.pub"
	SSHDConfigPath      = "/etc/ssh/sshd_config.d/50-eitri.conf"
)

var principalRe = regexp.MustCompile(`^[A-Za-z0-9@._-]{1,128}$`)

// ErrInvalidParams wraps every validation failure, so callers can treat a bad
// seed request as permanent rather than retrying it.
var ErrInvalidParams = errors.New("invalid seed parameters")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidParams, fmt.Sprintf(format, args...))
}

// Validate reports whether p can be turned into a seed the guest will read
// the way it was meant.
func (p Params) Validate() error {
	if p.InstanceID == "" {
		return invalid("instance id is empty")
	}
	if hasControl(p.InstanceID) {
		return invalid("instance id contains control characters")
	}
	if err := validLabel(p.Hostname); err != nil {
		return err
	}
	if p.SSHAuthorizedKey != "" {
		if hasControl(p.SSHAuthorizedKey) {
			return invalid("authorized key must be one line without control characters")
		}
		if _, _, _, _, err := ssh.ParseAuthorizedKey([]byte(p.SSHAuthorizedKey)); err != nil {
			return invalid("authorized key: %v", err)
		}
	}
	if p.LoginUser != "" {
		if err := validUser(p.LoginUser); err != nil {
			return err
		}
	}
	if p.PhoneHomeURL != "" {
		if err := validHostURL("phone-home", p.PhoneHomeURL); err != nil {
			return err
		}
	}
	if p.HostCertURL != "" {
		if err := validHostURL("host certificate", p.HostCertURL); err != nil {
			return err
		}
		if p.HostPubKey == "" {
			return invalid("a host certificate URL without a host key")
		}
	}
	for _, k := range p.TrustedUserCAKeys {
		if err := validCAKey(k); err != nil {
			return err
		}
	}
	if len(p.TrustedUserCAKeys) > 0 {
		// Without its own principal a guest would take any certificate the
		// CA issued for the user name, another tenant's included.
		if p.LoginUser == "" || p.UserCertPrincipal == "" {
			return invalid("trusted user CA keys need a login user and a certificate principal")
		}
		if !principalRe.MatchString(p.UserCertPrincipal) {
			return invalid("certificate principal %q: only letters, digits and @._- (at most 128)", p.UserCertPrincipal)
		}
	}
	switch {
	case p.HostPrivKey == "" && p.HostPubKey == "":
		if p.HostCertificate != "" {
			return invalid("host certificate without a host key")
		}
		return nil
	case p.HostPrivKey == "" || p.HostPubKey == "":
		return invalid("host key needs both the private and the public half")
	}
	if err := validHostKey(p.HostPrivKey, p.HostPubKey); err != nil {
		return err
	}
	if p.HostCertificate != "" {
		return validHostCert(p.HostCertificate, p.HostPubKey)
	}
	return nil
}

// validCAKey accepts one public key line.
func validCAKey(k string) error {
	if hasControl(k) {
		return invalid("user CA key must be one line without control characters")
	}
	pk, _, _, _, err := ssh.ParseAuthorizedKey([]byte(k))
	if err != nil {
		return invalid("user CA key: %v", err)
	}
	if _, ok := pk.(*ssh.Certificate); ok {
		return invalid("user CA key is a certificate, not a key")
	}
	return nil
}

// validHostCert checks the certificate is a host certificate for the
// guest's own host key: sshd ignores one that matches no host key.
func validHostCert(certLine, pub string) error {
	if hasControl(certLine) {
		return invalid("host certificate must be one line without control characters")
	}
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(certLine))
	if err != nil {
		return invalid("host certificate: %v", err)
	}
	cert, ok := k.(*ssh.Certificate)
	if !ok || cert.CertType != ssh.HostCert {
		return invalid("host certificate is not an SSH host certificate")
	}
	pk, _, _, _, _ := ssh.ParseAuthorizedKey([]byte(pub)) // validHostKey parsed it
	if !bytes.Equal(cert.Key.Marshal(), pk.Marshal()) {
		return invalid("host certificate is for another key than the host key")
	}
	return nil
}

// validLabel accepts an RFC 1123 label: what a guest can set as its hostname
// without surprises.
func validLabel(h string) error {
	if h == "" {
		return invalid("hostname is empty")
	}
	if len(h) > 63 {
		return invalid("hostname %q is longer than 63 characters", h)
	}
	if h[0] == '-' || h[len(h)-1] == '-' {
		return invalid("hostname %q starts or ends with a hyphen", h)
	}
	for _, c := range []byte(h) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-'
		if !ok {
			return invalid("hostname %q: only letters, digits and hyphens are allowed", h)
		}
	}
	return nil
}

// validUser accepts the portable POSIX user names useradd takes everywhere
// (lower case, digits, _ and -, not starting with a digit or -), except
// root, which the seed must not reconfigure.
func validUser(u string) error {
	if len(u) > 32 {
		return invalid("login user %q is longer than 32 characters", u)
	}
	for i, c := range []byte(u) {
		ok := c >= 'a' && c <= 'z' || c == '_' || i > 0 && (c >= '0' && c <= '9' || c == '-')
		if !ok {
			return invalid("login user %q: only lower-case letters, digits, _ and - (not first) are allowed", u)
		}
	}
	if u == "root" {
		return invalid("login user must not be root")
	}
	return nil
}

// validHostURL accepts a plain http(s) URL with nothing YAML or Python
// could read differently: it is written into a script in the config.
func validHostURL(what, raw string) error {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" || u.User != nil {
		return invalid("%s URL %q is not an http(s) URL", what, raw)
	}
	for _, c := range []byte(raw) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte(":/.-_~[]%", c) >= 0
		if !ok {
			return invalid("%s URL %q has characters outside [A-Za-z0-9:/.-_~[]%%]", what, raw)
		}
	}
	return nil
}

// validHostKey checks the pair is ed25519 and belongs together: a mismatched
// pair would boot fine and then fail every host-key check a client makes.
func validHostKey(priv, pub string) error {
	if hasControl(pub) {
		return invalid("host public key must be one line without control characters")
	}
	for _, r := range priv {
		if r != '\n' && (r < 0x20 || r == 0x7f) {
			return invalid("host private key contains control characters")
		}
	}
	raw, err := ssh.ParseRawPrivateKey([]byte(priv))
	if err != nil {
		return invalid("host private key: %v", err)
	}
	var edPriv ed25519.PrivateKey
	switch k := raw.(type) {
	case ed25519.PrivateKey:
		edPriv = k
	case *ed25519.PrivateKey:
		edPriv = *k
	default:
		return invalid("host private key is %T, want ed25519", raw)
	}
	pk, _, _, _, err := ssh.ParseAuthorizedKey([]byte(pub))
	if err != nil {
		return invalid("host public key: %v", err)
	}
	if pk.Type() != ssh.KeyAlgoED25519 {
		return invalid("host public key is %s, want %s", pk.Type(), ssh.KeyAlgoED25519)
	}
	derived, err := ssh.NewPublicKey(edPriv.Public())
	if err != nil {
		return invalid("host private key: %v", err)
	}
	if !bytes.Equal(derived.Marshal(), pk.Marshal()) {
		return invalid("host public key does not match the private key")
	}
	return nil
}

func hasControl(s string) bool {
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return true
		}
	}
	return false
}

// Write builds the seed ISO for p at outPath. The file appears whole or not at
// all: a half-written seed found after a crash would boot a guest with no
// identity.
func Write(outPath string, p Params) error {
	if err := p.Validate(); err != nil {
		return err
	}
	iw, err := iso9660.NewWriter()
	if err != nil {
		return fmt.Errorf("seed: staging: %w", err)
	}
	defer iw.Cleanup()

	if err := iw.AddFile(strings.NewReader(MetaData(p)), "meta-data"); err != nil {
		return fmt.Errorf("seed: add meta-data: %w", err)
	}
	if err := iw.AddFile(strings.NewReader(UserData(p)), "user-data"); err != nil {
		return fmt.Errorf("seed: add user-data: %w", err)
	}

	dir := filepath.Dir(outPath)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(outPath)+".tmp-*")
	if err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if err := iw.WriteTo(tmp, VolumeID); err != nil {
		return fmt.Errorf("seed: write iso: %w", err)
	}
	// The seed carries a private host key: readable by the agent (and QEMU
	// running as the same user) only.
	if err := tmp.Chmod(0o600); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		return fmt.Errorf("seed: sync: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("seed: close: %w", err)
	}
	if err := os.Rename(tmp.Name(), outPath); err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	committed = true
	if d, err := os.Open(dir); err == nil {
		// Make the rename itself durable; best effort, the file is complete.
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// MetaData renders the NoCloud meta-data document for p. p must be valid.
func MetaData(p Params) string {
	var b strings.Builder
	b.WriteString("instance-id: " + quote(p.InstanceID) + "\n")
	b.WriteString("local-hostname: " + quote(p.Hostname) + "\n")
	return b.String()
}

// UserData renders the #cloud-config document for p. p must be valid.
func UserData(p Params) string {
	var b strings.Builder
	b.WriteString("#cloud-config\n")
	b.WriteString("hostname: " + quote(p.Hostname) + "\n")
	// An /etc/hosts naming the host, or every sudo complains it cannot
	// resolve it.
	b.WriteString("manage_etc_hosts: true\n")
	key := strings.TrimSpace(p.SSHAuthorizedKey)
	if p.LoginUser != "" {
		b.WriteString("users:\n")
		b.WriteString("  - default\n")
		b.WriteString("  - name: " + quote(p.LoginUser) + "\n")
		b.WriteString("    gecos: \"eitri login user\"\n")
		b.WriteString("    sudo: \"ALL=(ALL) NOPASSWD:ALL\"\n")
		b.WriteString("    lock_passwd: true\n")
		if key != "" {
			b.WriteString("    ssh_authorized_keys:\n")
			b.WriteString("      - " + quote(key) + "\n")
		}
	}
	if key != "" {
		// The top-level list is the image's default user's.
		b.WriteString("ssh_authorized_keys:\n")
		b.WriteString("  - " + quote(key) + "\n")
	}
	// Deleting the image's own host keys leaves only the agent's, so the
	// fingerprint the agent reported is the one clients will see.
	b.WriteString("ssh_deletekeys: true\n")
	if p.HostPrivKey != "" {
		b.WriteString("ssh_keys:\n")
		b.WriteString("  ed25519_private: |\n")
		for _, line := range strings.Split(strings.TrimRight(p.HostPrivKey, "\n"), "\n") {
			if strings.TrimSpace(line) == "" {
				b.WriteString("\n")
				continue
			}
			b.WriteString("    " + strings.TrimSpace(line) + "\n")
		}
		b.WriteString("  ed25519_public: " + quote(strings.TrimSpace(p.HostPubKey)) + "\n")
	}
	// write_files runs in cloud-init's first stage, before sshd starts.
	var files []seedFile
	if p.PhoneHomeURL != "" {
		files = append(files,
			seedFile{PhoneHomeScript, "0700", phoneHomeScript(p.PhoneHomeURL)},
			seedFile{PhoneHomeUnitPath, "0644", phoneHomeUnit})
	}
	var sshd []string
	if len(p.TrustedUserCAKeys) > 0 {
		var keys strings.Builder
		for _, k := range p.TrustedUserCAKeys {
			keys.WriteString(strings.TrimSpace(k) + "\n")
		}
		files = append(files, seedFile{UserCAKeysPath, "0644", keys.String()},
			seedFile{PrincipalsDir + "/" + p.LoginUser, "0644", p.UserCertPrincipal + "\n"})
		sshd = append(sshd, "TrustedUserCAKeys "+UserCAKeysPath, "AuthorizedPrincipalsFile "+PrincipalsDir+"/%u")
	}
	if p.HostCertificate != "" {
		files = append(files, seedFile{HostCertificatePath, "0644", strings.TrimSpace(p.HostCertificate) + "\n"})
	}
	if p.HostCertURL != "" {
		files = append(files,
			seedFile{HostCertScript, "0700", hostCertScript(p.HostCertURL)},
			seedFile{HostCertUnitPath, "0644", hostCertUnit},
			seedFile{HostCertTimerPath, "0644", hostCertTimer})
	}
	if p.HostCertificate != "" || p.HostCertURL != "" {
		// Named even before the timer has fetched a first certificate (a
		// guest its agent could not have certified in time): sshd logs
		// that it cannot load it and serves its plain key meanwhile.
		sshd = append(sshd, "HostCertificate "+HostCertificatePath)
	}
	if len(sshd) > 0 {
		files = append(files, seedFile{SSHDConfigPath, "0644",
			"# eitri: trust the control plane's SSH CAs (written by the seed).\n" + strings.Join(sshd, "\n") + "\n"})
	}
	if len(files) > 0 {
		b.WriteString("write_files:\n")
		for _, f := range files {
			b.WriteString("  - path: " + f.path + "\n")
			b.WriteString("    permissions: \"" + f.mode + "\"\n")
			b.WriteString("    content: |\n")
			for _, line := range strings.Split(strings.TrimRight(f.content, "\n"), "\n") {
				if line == "" {
					b.WriteString("\n")
					continue
				}
				b.WriteString("      " + line + "\n")
			}
		}
	}
	if p.PhoneHomeURL != "" || p.HostCertURL != "" {
		b.WriteString("runcmd:\n")
	}
	if p.PhoneHomeURL != "" {
		// Enabled for later boots, started for this one: --no-block
		// because runcmd runs inside cloud-final.service, which the unit
		// waits for.
		b.WriteString("  - [\"systemctl\", \"enable\", \"" + PhoneHomeUnit + "\"]\n")
		b.WriteString("  - [\"systemctl\", \"start\", \"--no-block\", \"" + PhoneHomeUnit + "\"]\n")
	}
	if p.HostCertURL != "" {
		b.WriteString("  - [\"systemctl\", \"enable\", \"" + HostCertTimer + "\"]\n")
		b.WriteString("  - [\"systemctl\", \"start\", \"--no-block\", \"" + HostCertTimer + "\"]\n")
	}
	return b.String()
}

// seedFile is one write_files entry.
type seedFile struct{ path, mode, content string }

// The phone home is a systemd unit rather than cloud-init's phone_home
// module: that module reads every type of host public key whatever its
// post list says and warns for each file missing, and the seed installs
// only the agent's ed25519 key. The unit runs once cloud-final.service is
// done, on every boot, so one mechanism covers the first boot and later
// ones.
const (
	// PhoneHomeUnit is the systemd unit that phones home.
	PhoneHomeUnit = "eitri-phone-home.service"
	// PhoneHomeUnitPath is where the seed writes it.
	PhoneHomeUnitPath = "/etc/systemd/system/" + PhoneHomeUnit
	// PhoneHomeScript is the program the unit runs; it holds the URL (so
	// it is root's alone: the URL's token is the VM's).
	PhoneHomeScript = "/usr/local/lib/eitri/phone-home"
	// PhoneHomeURLPrefix starts the script's one line that names the URL:
	// what the project's test guest, which has no Python, looks for.
	PhoneHomeURLPrefix = "URL = "
)

// phoneHomeUnit orders after cloud-final.service and is wanted by
// cloud-init.target, not multi-user.target: cloud-final is itself ordered
// after multi-user.target, so wanting the unit there would be a cycle.
const phoneHomeUnit = `[Unit]
Description=eitri: tell the host this guest has booted
After=cloud-final.service network-online.target
Wants=network-online.target

[Service]
Type=oneshot
ExecStart=/usr/bin/python3 ` + PhoneHomeScript + `
StandardOutput=journal+console

[Install]
WantedBy=cloud-init.target
`

// phoneHomeScript posts to the URL until the agent answers, a bounded
// number of times: a guest whose host endpoint is gone still finishes
// booting, and the agent falls back to probing ssh. python3 is there
// wherever cloud-init is; curl is not.
func phoneHomeScript(phoneHomeURL string) string {
	return `#!/usr/bin/python3
# eitri: tell the agent this boot is done (run after cloud-final.service).
import sys, time, urllib.parse, urllib.request

` + PhoneHomeURLPrefix + quote(phoneHomeURL) + `

def instance_id():
    try:
        with open("/var/lib/cloud/data/instance-id") as f:
            return f.read().strip()
    except OSError:
        return ""

body = urllib.parse.urlencode({"instance_id": instance_id()}).encode()
for attempt in range(1, 31):
    try:
        req = urllib.request.Request(URL, data=body, method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
        print("eitri: phoned home (attempt %d)" % attempt)
        sys.exit(0)
    except Exception as e:
        print("eitri: phone home attempt %d: %s" % (attempt, e), file=sys.stderr)
        time.sleep(2)
sys.exit(1)
`
}

// quote renders s as a YAML double-quoted scalar. JSON string syntax is a
// subset of YAML's double-quoted style, and quoting always keeps values such
// as "on", "null" or "0123" strings.
func quote(s string) string {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(s) // encoding a string cannot fail
	return strings.TrimSuffix(buf.String(), "\n")
}
