package fleet

import (
	"context"
	"crypto/rsa"
	"errors"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"
	"golang.org/x/time/rate"
	"google.golang.org/protobuf/types/known/timestamppb"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/sshca"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/bounds"
	"github.com/a73x/eitri/wire/sshcert"
)

// User certificate lifetimes: a certificate is for one login, and nothing
// can revoke it once issued, so it lives minutes.
const (
	DefaultUserCertTTL = 5 * time.Minute
	MaxUserCertTTL     = time.Hour
	// HostCertValidity is how long a guest's host certificate lives.
	// Nothing can revoke one short of rotating the host CA, so it is short;
	// agents renew it once it is a third of the way through (or ten days
	// old), and guests fetch the renewal from their agent every few hours,
	// so a month leaves some three weeks for a control plane or an agent
	// that is down.
	HostCertValidity = 30 * 24 * time.Hour
	// certBackdate covers clocks a little behind the control plane's (a
	// guest just booted under emulation, a laptop).
	certBackdate = time.Minute
	// minRSABits is the smallest RSA user key certified; smaller ones are
	// breakable.
	minRSABits = 2048
	// A user's certificates come in a burst (a script logging into a few
	// VMs), then one every few seconds: each is written to the VM's
	// timeline, which must not grow as fast as someone can ask.
	userCertBurst = 20
	userCertEvery = 3 * time.Second
)

// certLimits holds each user's certificate allowance.
type certLimits struct {
	mu sync.Mutex
	m  map[string]*rate.Limiter
}

func (l *certLimits) allow(userID string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]*rate.Limiter{}
	}
	lim := l.m[userID]
	if lim == nil {
		lim = rate.NewLimiter(rate.Every(userCertEvery), userCertBurst)
		l.m[userID] = lim
	}
	ok := lim.AllowN(now, 1)
	// A full allowance is the same as none: forget those, so the map holds
	// only users asking now.
	if len(l.m) > 64 {
		for id, o := range l.m {
			if o.TokensAt(now) >= userCertBurst {
				delete(l.m, id)
			}
		}
	}
	return ok
}

// loginUserRe is a portable POSIX user name, as the seed creates.
var loginUserRe = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)

// Event kinds of the certificates issued for a VM, in its timeline.
const (
	eventSSHCert     = "ssh-cert"
	eventSSHHostCert = "ssh-host-cert"
)

func (f *Fleet) ca() (*sshca.Authority, error) {
	if f.cfg.SSHCA == nil {
		return nil, errorf(Precondition, "this control plane has no SSH certificate authority")
	}
	return f.cfg.SSHCA, nil
}

// SSHCAKeys returns the CAs' public keys; anyone signed in may read them.
func (f *Fleet) SSHCAKeys(ctx context.Context) (*eitriv1.GetSSHCAKeysResponse, error) {
	if _, err := principal(ctx); err != nil {
		return nil, err
	}
	ca, err := f.ca()
	if err != nil {
		return nil, err
	}
	out := &eitriv1.GetSSHCAKeysResponse{}
	for i, k := range ca.Trusted(sshca.User) {
		out.UserCaKeys = append(out.UserCaKeys, caKey(k, i > 0))
	}
	for i, k := range ca.Trusted(sshca.Host) {
		out.HostCaKeys = append(out.HostCaKeys, caKey(k, i > 0))
		out.KnownHosts = append(out.KnownHosts, sshca.KnownHostsLine(k))
	}
	return out, nil
}

// RotateSSHCA replaces the user or host CA's key (admin only); see
// sshca.Authority.Rotate for what stays trusted.
func (f *Fleet) RotateSSHCA(ctx context.Context, which string) (*eitriv1.GetSSHCAKeysResponse, error) {
	p, err := requireAdmin(ctx)
	if err != nil {
		return nil, err
	}
	k := sshca.Kind(which)
	if k != sshca.User && k != sshca.Host {
		return nil, invalid("ca", "\"user\" or \"host\"")
	}
	ca, err := f.ca()
	if err != nil {
		return nil, err
	}
	if err := ca.Rotate(k); err != nil {
		return nil, err
	}
	if f.cfg.SecretsChanged != nil {
		if err := f.cfg.SecretsChanged(ctx); err != nil {
			// This replica signs with the new key; the others would not
			// trust what it signs until they have it.
			return nil, fmt.Errorf("share the rotated CA with the other replicas: %w", err)
		}
	}
	f.log.Info("SSH CA rotated", "ca", which, "by", p.Name, "key", ssh.FingerprintSHA256(ca.PublicKey(k)))
	if k == sshca.User {
		// Guests still to be seeded trust the new key too.
		f.mu.Lock()
		hosts := make([]string, 0, len(f.sessions))
		for id := range f.sessions {
			hosts = append(hosts, id)
		}
		f.mu.Unlock()
		for _, h := range hosts {
			f.kick(h)
		}
	}
	return f.SSHCAKeys(ctx)
}

func caKey(k ssh.PublicKey, previous bool) *eitriv1.SSHCAKey {
	return &eitriv1.SSHCAKey{PublicKey: sshca.AuthorizedKey(k), Fingerprint: ssh.FingerprintSHA256(k), Previous: previous}
}

// userCATrust is what a VM's guest trusts, read against the user CA now:
// each key it was seeded with, whether the CA signs with it, and — when it
// signs with none of them — that the guest is stale and how to fix it.
func (f *Fleet) userCATrust(seeded []string) ([]*eitriv1.TrustedCA, bool, string) {
	if len(seeded) == 0 || f.cfg.SSHCA == nil {
		return nil, false, ""
	}
	current := f.caLines.current(f.cfg.SSHCA.PublicKey(sshca.User))
	out := make([]*eitriv1.TrustedCA, 0, len(seeded))
	stale := true
	for _, line := range seeded {
		k := f.caLines.parse(line)
		ca := &eitriv1.TrustedCA{PublicKey: line, Current: k.key != "" && k.key == current, Fingerprint: k.fingerprint}
		if ca.Current {
			stale = false
		}
		out = append(out, ca)
	}
	if !stale {
		return out, false, ""
	}
	return out, true, "the guest trusts only user CAs rotated out since it was created, so eitri ssh certificates are refused; " +
		"add the current user CA (eitri ssh-ca) to " + seedUserCAPath + " in the guest (log in with the VM's own key), or recreate the VM"
}

// keyLines keeps what userCATrust derives from authorized_keys lines: every
// VM view asks it, and a watcher's first message holds every VM, so
// parsing and hashing each line each time cost more than the rest of the
// view. The lines are the user CA's own keys (seeded into guests), so
// there are a handful; the map is cleared should it ever grow past that.
type keyLines struct {
	mu   sync.Mutex
	wire string // the current key's wire form, and
	line string // its key part ("type base64"), as last rendered
	seen map[string]parsedLine
}

// parsedLine is an authorized_keys line's key part ("type base64", no
// comment; "" when it has fewer than two fields) and its fingerprint (""
// when it does not parse).
type parsedLine struct{ key, fingerprint string }

const keyLinesKept = 64

// current returns k's key part, rendered again only when the CA rotated.
func (c *keyLines) current(k ssh.PublicKey) string {
	wire := string(k.Marshal())
	c.mu.Lock()
	defer c.mu.Unlock()
	if wire != c.wire {
		c.wire, c.line = wire, keyPart(sshca.AuthorizedKey(k))
	}
	return c.line
}

func (c *keyLines) parse(line string) parsedLine {
	c.mu.Lock()
	p, ok := c.seen[line]
	c.mu.Unlock()
	if ok {
		return p
	}
	p.key = keyPart(line)
	if k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line)); err == nil {
		p.fingerprint = ssh.FingerprintSHA256(k)
	}
	c.mu.Lock()
	if c.seen == nil || len(c.seen) >= keyLinesKept {
		c.seen = map[string]parsedLine{}
	}
	c.seen[line] = p
	c.mu.Unlock()
	return p
}

// keyPart is an authorized_keys line's type and key, without its comment
// ("" when it has fewer than two fields): two lines name the same key
// when their key parts are equal.
func keyPart(line string) string {
	fs := strings.Fields(line)
	if len(fs) < 2 {
		return ""
	}
	return fs[0] + " " + fs[1]
}

// seedUserCAPath is where a guest's seed puts the user CA keys sshd trusts.
const seedUserCAPath = "/etc/ssh/eitri_user_ca.pub"

// trustedUserCAKeys is what every guest's seed trusts (VMDesired): empty
// without a CA.
func (f *Fleet) trustedUserCAKeys() []string {
	if f.cfg.SSHCA == nil {
		return nil
	}
	var out []string
	for _, k := range f.cfg.SSHCA.Trusted(sshca.User) {
		out = append(out, sshca.AuthorizedKey(k))
	}
	return out
}

// SignUserKey certifies the caller's key to log into one of their VMs as
// its login user, briefly, and records it on the VM.
func (f *Fleet) SignUserKey(ctx context.Context, r *eitriv1.SignUserKeyRequest) (*eitriv1.SignUserKeyResponse, error) {
	// Validate what costs nothing before touching the store.
	if err := checkLen("public_key", r.GetPublicKey(), bounds.MaxSSHKeyLen); err != nil {
		return nil, err
	}
	ttl := DefaultUserCertTTL
	if r.Ttl != nil {
		if err := r.GetTtl().CheckValid(); err != nil {
			return nil, invalid("ttl", "%v", err)
		}
		ttl = r.GetTtl().AsDuration()
		if ttl <= 0 {
			return nil, invalid("ttl", "must be positive (leave it unset for %s)", DefaultUserCertTTL)
		}
		if ttl > MaxUserCertTTL {
			return nil, invalid("ttl", "at most %s, got %s", MaxUserCertTTL, ttl)
		}
	}
	pub, err := userKey(r.GetPublicKey())
	if err != nil {
		return nil, err
	}
	vm, p, err := f.visible(ctx, r.GetVmId())
	if err != nil {
		return nil, invalidAs("vm_id", err)
	}
	ca, err := f.ca()
	if err != nil {
		return nil, err
	}
	if vm.DeletedAt != nil {
		return nil, errorf(Precondition, "vm %s is deleted", vm.ID)
	}
	if !f.userCerts.allow(p.UserID, f.now()) {
		return nil, errorf(Exhausted, "more than %d SSH certificates in a row; one more every %s", userCertBurst, userCertEvery)
	}
	row, _ := f.reg.VM(vm.HostID, vm.ID)
	login := row.GetLoginUser()
	if login == "" {
		// Never a certificate without a principal: sshd takes that as any
		// user.
		return nil, errorf(Precondition, "vm %s has no login user yet (its host has not reported one); try again once it is created", vm.ID)
	}
	if !loginUserRe.MatchString(login) {
		// The host's word goes into a certificate: only a plain user name.
		return nil, errorf(Precondition, "vm %s: its host reported an unusable login user", vm.ID)
	}
	now := f.now()
	v := sshca.Validity{After: now.Add(-certBackdate), Before: now.Add(ttl)}
	keyID := fmt.Sprintf("eitri user %s (%s) vm %s (%s)", p.Name, p.UserID, vm.Name, vm.ID)
	principal := sshcert.Principal(login, vm.ID)
	cert, err := ca.Sign(sshca.User, pub, keyID, []string{principal}, v)
	if err != nil {
		return nil, err
	}
	// No certificate leaves unrecorded: it cannot be revoked, so the
	// timeline is the only account of who could log in.
	if err := f.st.AddVMEvent(context.WithoutCancel(ctx), store.VMEvent{VMID: vm.ID, At: now, Kind: eventSSHCert,
		Message: fmt.Sprintf("%s was issued an SSH certificate as %s for key %s: serial %d, valid %s to %s",
			p.Name, principal, ssh.FingerprintSHA256(pub), cert.Serial, v.After.Format(time.RFC3339), v.Before.Format(time.RFC3339))}); err != nil {
		return nil, storeErr(err, "vm "+vm.ID)
	}
	return &eitriv1.SignUserKeyResponse{
		Certificate: sshca.AuthorizedKey(cert), Principal: principal, LoginUser: login, Serial: cert.Serial, KeyId: keyID,
		ValidAfter: timestamppb.New(v.After), ValidBefore: timestamppb.New(v.Before),
	}, nil
}

// invalidAs names field in a validation error about the VM id (visible
// says "id").
func invalidAs(field string, err error) error {
	if e, ok := err.(*Error); ok && e.Kind == Invalid && strings.HasPrefix(e.Msg, "id: ") {
		return &Error{Kind: Invalid, Msg: field + ": " + strings.TrimPrefix(e.Msg, "id: ")}
	}
	return err
}

// userKey parses a key a person wants certified: one authorized_keys line
// of a type and size worth certifying.
func userKey(line string) (ssh.PublicKey, error) {
	line = strings.TrimSpace(line)
	if line == "" {
		return nil, invalid("public_key", "required (an authorized_keys line such as \"ssh-ed25519 AAAA...\")")
	}
	if hasControl(line) {
		return nil, invalid("public_key", "must be one line without control characters")
	}
	pub, _, _, rest, err := ssh.ParseAuthorizedKey([]byte(line))
	if err != nil {
		return nil, invalid("public_key", "not an SSH public key: %v", err)
	}
	if len(rest) > 0 {
		return nil, invalid("public_key", "one key only")
	}
	switch pub.Type() {
	case ssh.KeyAlgoED25519, ssh.KeyAlgoSKED25519, ssh.KeyAlgoECDSA256, ssh.KeyAlgoECDSA384, ssh.KeyAlgoECDSA521, ssh.KeyAlgoSKECDSA256:
		return pub, nil
	case ssh.KeyAlgoRSA:
		ck, ok := pub.(ssh.CryptoPublicKey)
		if !ok {
			return nil, invalid("public_key", "unreadable RSA key")
		}
		rk, ok := ck.CryptoPublicKey().(*rsa.PublicKey)
		if !ok || rk.N.BitLen() < minRSABits {
			return nil, invalid("public_key", "RSA keys need at least %d bits; ed25519 is better", minRSABits)
		}
		return pub, nil
	}
	if _, ok := pub.(*ssh.Certificate); ok {
		return nil, invalid("public_key", "is a certificate; send the plain public key")
	}
	return nil, invalid("public_key", "%s keys are not certified; use ed25519, ECDSA or RSA", pub.Type())
}

func hasControl(s string) bool {
	for _, r := range s {
		if r < 0x20 || r == 0x7f {
			return true
		}
	}
	return false
}

// hostPrincipals are the names a guest's host certificate vouches for:
// only names eitri gives out, the VM's id and its alias. Never the VM's
// name: its owner chooses it and is root in the guest holding the
// certificate, so a name copied from another VM's alias, or "localhost",
// would be a certificate to pass as that host.
func hostPrincipals(vmID string) []string { return []string{vmID, sshcert.HostAlias(vmID)} }

// SignHostKey certifies a guest's host key for the host the VM is placed
// on, for hostPrincipals, for HostCertValidity. Agents call it again to
// renew.
func (f *Fleet) SignHostKey(ctx context.Context, hostID string, r *eitriv1.SignHostKeyRequest) (*eitriv1.SignHostKeyResponse, error) {
	if err := checkLen("vm_id", r.GetVmId(), bounds.MaxIDLen); err != nil {
		return nil, err
	}
	if err := checkLen("public_key", r.GetPublicKey(), bounds.MaxSSHKeyLen); err != nil {
		return nil, err
	}
	if r.GetVmId() == "" {
		return nil, invalid("vm_id", "required")
	}
	line := strings.TrimSpace(r.GetPublicKey())
	if hasControl(line) {
		return nil, invalid("public_key", "must be one line without control characters")
	}
	pub, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line))
	if err != nil {
		return nil, invalid("public_key", "not an SSH public key: %v", err)
	}
	if pub.Type() != ssh.KeyAlgoED25519 {
		return nil, invalid("public_key", "host keys are %s, got %s", ssh.KeyAlgoED25519, pub.Type())
	}
	vm, err := f.st.GetVM(ctx, r.GetVmId())
	if err != nil && !errors.Is(err, store.ErrNotFound) {
		return nil, err
	}
	if err != nil || vm.HostID != hostID {
		// Another host's VM is as absent as a missing one.
		return nil, errorf(NotFound, "vm %s not found on this host", r.GetVmId())
	}
	ca, err := f.ca()
	if err != nil {
		return nil, err
	}
	now := f.now()
	v := sshca.Validity{After: now.Add(-certBackdate), Before: now.Add(HostCertValidity)}
	cert, err := ca.Sign(sshca.Host, pub, fmt.Sprintf("eitri guest %s (%s)", vm.Name, vm.ID), hostPrincipals(vm.ID), v)
	if err != nil {
		return nil, err
	}
	f.event(ctx, vm.ID, eventSSHHostCert, fmt.Sprintf("host key %s certified by the host CA as %s: serial %d, valid until %s",
		ssh.FingerprintSHA256(pub), strings.Join(cert.ValidPrincipals, ", "), cert.Serial, v.Before.Format(time.RFC3339)))
	return &eitriv1.SignHostKeyResponse{Certificate: sshca.AuthorizedKey(cert)}, nil
}
