package reconcile

import (
	"context"
	"math"
	"sync"
	"time"

	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/agent/state"
)

// Host certificates are short-lived (the control plane signs them for a
// month), so the engine has each running guest's certificate made again
// while the old one has most of its life left; the guest fetches the
// renewal from this host (the seed's timer, through HostCertURL) and
// reloads sshd.
const (
	// hostCertRenewAge is the age at which a certificate is renewed
	// whatever its life: a third of the control plane's month, and at
	// once for certificates signed before certificates were short, or by
	// a host CA key that has since been rotated out.
	hostCertRenewAge = 10 * 24 * time.Hour
	// hostCertRetry is the wait after a renewal that failed (a control
	// plane down or refusing): the certificate in place has weeks left.
	hostCertRetry = time.Hour
)

// hostCertDue says whether the certificate line should be replaced now:
// none, unreadable, or a third of its life (at most hostCertRenewAge)
// gone.
func hostCertDue(line string, now time.Time) bool {
	if line == "" {
		return true
	}
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line))
	if err != nil {
		return true
	}
	cert, ok := k.(*ssh.Certificate)
	if !ok {
		return true
	}
	after := time.Unix(int64(min(cert.ValidAfter, math.MaxInt64)), 0)
	life := time.Duration(math.MaxInt64) // "forever" (CertTimeInfinity)
	if cert.ValidBefore < math.MaxInt64 {
		life = time.Unix(int64(cert.ValidBefore), 0).Sub(after)
	}
	return !now.Before(after.Add(min(hostCertRenewAge, life/3)))
}

// hostCertRetries remembers when each VM whose renewal failed may try
// again. Memory only: an agent that restarts tries once at once.
type hostCertRetries struct {
	mu sync.Mutex
	at map[string]time.Time
}

func (r *hostCertRetries) wait(id string, now time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return now.Before(r.at[id])
}

func (r *hostCertRetries) set(id string, at time.Time) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if at.IsZero() {
		delete(r.at, id)
		return
	}
	if r.at == nil {
		r.at = map[string]time.Time{}
	}
	r.at[id] = at
}

// renewHostCert has the guest's host key certified again when its
// certificate is due (or it has none: a create that could not reach the
// control plane), and records it. A failure is logged and tried again
// after hostCertRetry; the guest keeps the certificate it has, and
// clients that pinned its key (eitri ssh) do not need one.
func (e *Engine) renewHostCert(ctx context.Context, id string, rec state.Record) state.Record {
	if e.cfg.SignHostKey == nil || rec.HostPubKey == "" {
		return rec
	}
	now := e.cfg.Now()
	if !hostCertDue(rec.HostCert, now) || e.certRetries.wait(id, now) {
		return rec
	}
	cert, err := e.certifyHostKey(ctx, id, rec.HostPubKey)
	if err != nil {
		e.log.Warn("SSH host certificate not renewed; will try again", "vm", id, "err", err, "in", hostCertRetry)
		e.certRetries.set(id, now.Add(hostCertRetry))
		return rec
	}
	e.certRetries.set(id, time.Time{})
	rec.HostCert = cert
	e.save(id, rec)
	e.log.Info("SSH host certificate renewed", "vm", id)
	return rec
}
