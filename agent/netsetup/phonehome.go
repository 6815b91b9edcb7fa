package netsetup

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// A guest says it has finished booting by an HTTP POST to its own URL on
// the bridge address (the seed's phone-home unit, or anything that can POST).
// The URL carries a token only that VM's seed holds: an HMAC of its id
// under a key this host keeps, so no table of tokens is needed and one
// guest cannot speak for another. The request must also come from the
// VM's own leased address, which the guest filter keeps unforgeable.

// DefaultPhoneHomePort is where the phone-home endpoint listens on the
// bridge address.
const DefaultPhoneHomePort = 7480

const (
	phoneHomeKeyName = "phone-home.key"
	phoneHomePath    = "/eitri/phone-home/"
	// phoneHomeMaxBody bounds what a guest may post (cloud-init's post: all
	// sends its host keys, a few KiB).
	phoneHomeMaxBody = 64 << 10
	// phoneHomePersistEvery bounds how often one VM's phone home is written
	// to the lease file: a guest posting in a loop must not be a disk load.
	phoneHomePersistEvery = time.Minute
)

// loadOrCreateKey reads the phone-home key beside the lease file, making
// one the first time.
func loadOrCreateKey(dir string) ([]byte, error) {
	path := filepath.Join(dir, phoneHomeKeyName)
	key, err := os.ReadFile(path)
	if err == nil && len(key) == 32 {
		return key, nil
	}
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("netsetup: phone-home key: %w", err)
	}
	key = make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("netsetup: phone-home key: %w", err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, key, 0o600); err != nil {
		return nil, fmt.Errorf("netsetup: phone-home key: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return nil, fmt.Errorf("netsetup: phone-home key: %w", err)
	}
	return key, nil
}

func (n *Network) phoneHomeToken(vmID string) string {
	m := hmac.New(sha256.New, n.phoneKey)
	m.Write([]byte("eitri phone-home\x00" + vmID))
	return hex.EncodeToString(m.Sum(nil)[:16])
}

// PhoneHomeURL is where the VM's guest posts once it has booted; "" when
// the endpoint is not running.
func (n *Network) PhoneHomeURL(vmID string) string {
	return n.guestURL(phoneHomePath, vmID)
}

// guestURL is the VM's own URL under path on the endpoint, carrying its
// token; "" when the endpoint is not running.
func (n *Network) guestURL(path, vmID string) string {
	if n.phoneSrv == nil {
		return ""
	}
	host := net.JoinHostPort(n.pool.gateway.String(), strconv.Itoa(int(n.phonePort)))
	return "http://" + host + path + vmID + "/" + n.phoneHomeToken(vmID)
}

// PhonedHomeAt is when the VM's guest last phoned home, if it ever did.
func (n *Network) PhonedHomeAt(vmID string) (time.Time, bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	l, ok := n.leases[vmID]
	if !ok || l.PhonedAt == nil {
		return time.Time{}, false
	}
	return *l.PhonedAt, true
}

// startPhoneHomeOrWarn runs the endpoint if it can: without it guests are
// seeded with no phone home and become ready by their other signals, which
// is no reason to leave the host without a network.
func (n *Network) startPhoneHomeOrWarn() error {
	if err := n.startPhoneHome(); err != nil {
		n.log.Warn("no phone-home endpoint; guests will be ready by ssh or their address instead", "err", err)
	}
	return nil
}

func (n *Network) startPhoneHome() error {
	addr := netip.AddrPortFrom(n.pool.gateway, n.phonePort)
	ln, err := net.Listen("tcp", addr.String())
	if err != nil {
		return fmt.Errorf("netsetup: phone-home endpoint on %s: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("POST "+phoneHomePath+"{vm}/{token}", n.handlePhoneHome)
	mux.HandleFunc("GET "+hostCertPath+"{vm}/{token}", n.handleHostCert)
	n.phoneSrv = &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       10 * time.Second,
		WriteTimeout:      10 * time.Second,
		IdleTimeout:       30 * time.Second,
		MaxHeaderBytes:    8 << 10,
	}
	n.phoneDone = make(chan struct{})
	go func() {
		defer close(n.phoneDone)
		if err := n.phoneSrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			n.log.Warn("phone-home endpoint stopped", "err", err)
		}
	}()
	return nil
}

// handlePhoneHome records that a guest finished booting. Anything wrong
// (unknown VM, bad token, another address) is the same 404, so the
// endpoint tells a prober nothing.
func (n *Network) handlePhoneHome(w http.ResponseWriter, r *http.Request) {
	vmID, token := r.PathValue("vm"), r.PathValue("token")
	src, err := netip.ParseAddrPort(r.RemoteAddr)
	want := n.phoneHomeToken(vmID)
	if err != nil || !hmac.Equal([]byte(token), []byte(want)) || !n.markPhoned(vmID, src.Addr().Unmap()) {
		n.log.Debug("phone home refused", "vm", vmID, "from", r.RemoteAddr)
		http.NotFound(w, r)
		return
	}
	// The body (cloud-init's form) says nothing the agent needs; read it
	// so the client sees its post accepted whole.
	_, _ = io.Copy(io.Discard, http.MaxBytesReader(w, r.Body, phoneHomeMaxBody))
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, "ok\n")
}

// markPhoned records a phone home from src for the VM if src is the VM's
// leased address.
func (n *Network) markPhoned(vmID string, src netip.Addr) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	l, ok := n.leases[vmID]
	if !ok || l.Addr != src {
		return false
	}
	now := time.Now().UTC()
	persist := l.PhonedAt == nil || now.Sub(l.phonedSaved) >= phoneHomePersistEvery
	l.PhonedAt = &now
	if persist {
		l.phonedSaved = now
		if err := n.saveLocked(); err != nil {
			n.log.Warn("phone home: persist lease", "vm", vmID, "err", err)
		}
	}
	n.log.Info("guest phoned home", "vm", vmID, "addr", src)
	return true
}
