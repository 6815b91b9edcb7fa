package netsetup

import (
	"crypto/hmac"
	"io"
	"net/http"
	"net/netip"
)

// A guest's SSH host certificate is short-lived and renewed by the agent;
// the guest fetches the current one from its own URL on the phone-home
// endpoint (the seed installs a timer that does, and reloads sshd), so a
// guest that runs for months keeps presenting a valid one. The URL carries
// the VM's phone-home token and must be asked from the VM's leased
// address: a certificate is public, but one guest has no business reading
// another's.

const hostCertPath = "/eitri/host-cert/"

// HostCertURL is where the VM's guest fetches its current host certificate;
// "" when the endpoint is not running or nothing serves certificates.
func (n *Network) HostCertURL(vmID string) string {
	if n.cfg.HostCerts == nil {
		return ""
	}
	return n.guestURL(hostCertPath, vmID)
}

// handleHostCert answers a guest's request for its certificate. Anything
// wrong, and no certificate, is the same 404.
func (n *Network) handleHostCert(w http.ResponseWriter, r *http.Request) {
	vmID, token := r.PathValue("vm"), r.PathValue("token")
	src, err := netip.ParseAddrPort(r.RemoteAddr)
	if err != nil || n.cfg.HostCerts == nil || !hmac.Equal([]byte(token), []byte(n.phoneHomeToken(vmID))) || !n.leasedTo(vmID, src.Addr()) {
		n.log.Debug("host certificate request refused", "vm", vmID, "from", r.RemoteAddr)
		http.NotFound(w, r)
		return
	}
	cert := n.cfg.HostCerts(vmID)
	if cert == "" {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = io.WriteString(w, cert+"\n")
}

// leasedTo says whether src is the VM's leased address.
func (n *Network) leasedTo(vmID string, src netip.Addr) bool {
	addr, _ := n.Leased(vmID)
	return addr.IsValid() && addr == src.Unmap()
}
