package seed

// The host certificate's renewal in the guest. cloud-init writes the
// seed's files once, on the first boot, and a running guest reads no seed
// again, so a certificate that lives a month needs the guest's help to be
// replaced: a timer fetches the agent's current certificate from the
// guest's own URL (Params.HostCertURL) a few minutes after every boot and
// every few hours, and installs it only if it certifies the guest's own
// host key. sshd re-reads its certificate when reloaded, which keeps open
// sessions.
const (
	// HostCertTimer runs HostCertUnit.
	HostCertTimer     = "eitri-host-cert.timer"
	HostCertTimerPath = "/etc/systemd/system/" + HostCertTimer
	// HostCertUnit fetches and installs the certificate once.
	HostCertUnit     = "eitri-host-cert.service"
	HostCertUnitPath = "/etc/systemd/system/" + HostCertUnit
	// HostCertScript is the program the unit runs; it holds the URL (so it
	// is root's alone, as the phone home's is).
	HostCertScript = "/usr/local/lib/eitri/host-cert"
	// HostKeyPubPath is where cloud-init writes the seed's host public key.
	HostKeyPubPath = "/etc/ssh/ssh_host_ed25519_key.pub"
)

// The agent renews a certificate ten days into its month; fetching every
// six hours puts the renewal in place well before the old one expires, and
// the random delay keeps a host's guests from asking all at once.
const hostCertTimer = `[Unit]
Description=eitri: fetch this guest's renewed SSH host certificate

[Timer]
OnBootSec=2min
OnUnitActiveSec=6h
RandomizedDelaySec=10min

[Install]
WantedBy=timers.target
`

const hostCertUnit = `[Unit]
Description=eitri: install this guest's current SSH host certificate
After=network-online.target
Wants=network-online.target

[Service]
Type=oneshot
ExecStart=/usr/bin/python3 ` + HostCertScript + `
`

// hostCertScript fetches the certificate, checks it is an ed25519 host
// certificate for this guest's host key (anything else would only make
// sshd refuse it), writes it atomically when it changed and reloads sshd
// (ssh.service on Debian and Ubuntu, sshd.service elsewhere; a name that
// is not there fails harmlessly). An unreachable host or no certificate
// leaves the one installed; the next run tries again.
func hostCertScript(certURL string) string {
	return `#!/usr/bin/python3
# eitri: install this guest's current SSH host certificate, renewed by its
# host, and have sshd present it (run by ` + HostCertTimer + `).
import base64, os, subprocess, sys, urllib.request

` + PhoneHomeURLPrefix + quote(certURL) + `
CERT = ` + quote(HostCertificatePath) + `
HOST_KEY = ` + quote(HostKeyPubPath) + `
RELOAD = [["systemctl", "try-reload-or-restart", "ssh.service"],
          ["systemctl", "try-reload-or-restart", "sshd.service"]]
CERT_TYPE = "ssh-ed25519-cert-v01@openssh.com"
SSH2_CERT_TYPE_HOST = 2


def fields(blob, n):
    """The first n SSH wire strings of blob, and where they end."""
    out, i = [], 0
    for _ in range(n):
        if i + 4 > len(blob):
            raise ValueError("truncated key")
        size = int.from_bytes(blob[i:i + 4], "big")
        if i + 4 + size > len(blob):
            raise ValueError("truncated key")
        out.append(blob[i + 4:i + 4 + size])
        i += 4 + size
    return out, i


def certified_key(line):
    """The key an ed25519 host certificate line certifies."""
    parts = line.split()
    if len(parts) < 2 or parts[0] != CERT_TYPE or "\n" in line or "\r" in line:
        raise ValueError("not an ed25519 host certificate")
    blob = base64.b64decode(parts[1], validate=True)
    (kind, _nonce, key), end = fields(blob, 3)
    # The serial (8 bytes), then the certificate's type.
    if kind != CERT_TYPE.encode() or int.from_bytes(blob[end + 8:end + 12], "big") != SSH2_CERT_TYPE_HOST:
        raise ValueError("not an ed25519 host certificate")
    return key


def main():
    try:
        with urllib.request.urlopen(URL, timeout=20) as resp:
            new = resp.read(16384).decode("ascii").strip()
    except Exception as e:
        print("eitri: no host certificate from the host (%s); keeping the one installed" % e)
        return 0
    try:
        with open(HOST_KEY) as f:
            own = fields(base64.b64decode(f.read().split()[1], validate=True), 2)[0][1]
        if certified_key(new) != own:
            raise ValueError("it certifies another key than this guest's")
    except (OSError, ValueError, IndexError) as e:
        print("eitri: refusing the host's certificate: %s" % e, file=sys.stderr)
        return 1
    try:
        with open(CERT) as f:
            if f.read().strip() == new:
                return 0
    except OSError:
        pass
    tmp = CERT + ".tmp"
    with open(tmp, "w") as f:
        f.write(new + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, CERT)
    for cmd in RELOAD:
        try:
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        except OSError:
            pass
    print("eitri: installed a renewed host certificate")
    return 0


sys.exit(main())
`
}
