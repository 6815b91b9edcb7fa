package reconcile

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
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

// hostCertRenewAt is when the certificate line should be replaced: at
// once for none or an unreadable one, else once a third of its life (at
// most hostCertRenewAge) is gone.
func hostCertRenewAt(line string) time.Time {
	if line == "" {
		return time.Time{}
	}
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line))
	if err != nil {
		return time.Time{}
	}
	cert, ok := k.(*ssh.Certificate)
	if !ok {
		return time.Time{}
	}
	after := time.Unix(int64(min(cert.ValidAfter, math.MaxInt64)), 0)
	life := time.Duration(math.MaxInt64) // "forever" (CertTimeInfinity)
	if cert.ValidBefore < math.MaxInt64 {
		life = time.Unix(int64(cert.ValidBefore), 0).Sub(after)
	}
	return after.Add(min(hostCertRenewAge, life/3))
}

// hostCertChecks remembers, per VM, the certificate line it last read and
// when to look at it again: when it falls due, or hostCertRetry after a
// renewal failed. A running VM's pass then reads a time, not the
// certificate. Memory only: an agent that restarts reads each line again
// (and retries a failed renewal at once).
type hostCertChecks struct {
	mu sync.Mutex
	by map[string]hostCertCheck
}

type hostCertCheck struct {
	line string
	at   time.Time
}

// due says whether the VM's certificate line should be renewed now.
func (c *hostCertChecks) due(id, line string, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch, ok := c.by[id]
	if !ok || ch.line != line {
		ch = hostCertCheck{line: line, at: hostCertRenewAt(line)}
		if c.by == nil {
			c.by = map[string]hostCertCheck{}
		}
		c.by[id] = ch
	}
	return !now.Before(ch.at)
}

// retryAt holds the VM's renewal back until at.
func (c *hostCertChecks) retryAt(id, line string, at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.by == nil {
		c.by = map[string]hostCertCheck{}
	}
	c.by[id] = hostCertCheck{line: line, at: at}
}

// forget drops a VM that is gone from this host.
func (c *hostCertChecks) forget(id string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.by, id)
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
	if !e.certChecks.due(id, rec.HostCert, now) {
		return rec
	}
	cert, err := e.certifyHostKey(ctx, id, rec.HostPubKey)
	if err != nil {
		e.log.Warn("SSH host certificate not renewed; will try again", "vm", id, "err", err, "in", hostCertRetry)
		e.certChecks.retryAt(id, rec.HostCert, now.Add(hostCertRetry))
		return rec
	}
	rec.HostCert = cert
	e.save(id, rec)
	e.log.Info("SSH host certificate renewed", "vm", id)
	return rec
}

// certifyHostKey asks the control plane for the guest's host certificate,
// for no longer than SignTimeout.
func (e *Engine) certifyHostKey(ctx context.Context, id, pub string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, e.cfg.SignTimeout)
	defer cancel()
	line, err := e.cfg.SignHostKey(ctx, id, pub)
	if err != nil {
		return "", err
	}
	line = strings.TrimSpace(line)
	// A certificate the seed would refuse must not fail the VM: it is
	// dropped here, and the guest boots uncertified.
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(line))
	if err != nil {
		return "", fmt.Errorf("the control plane's host certificate: %w", err)
	}
	want, _, _, _, err := ssh.ParseAuthorizedKey([]byte(pub))
	if err != nil {
		return "", err
	}
	cert, ok := k.(*ssh.Certificate)
	if !ok || cert.CertType != ssh.HostCert || !bytes.Equal(cert.Key.Marshal(), want.Marshal()) || strings.ContainsAny(line, "\r\n") {
		return "", errors.New("the control plane's host certificate is not one for this guest's host key")
	}
	return line, nil
}
