package seed_test

import (
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/agent/seed"
)

func withHostCertURL(t *testing.T) seed.Params {
	p := validParams(t)
	p.HostCertURL = "http://10.77.0.1:7480/eitri/host-cert/vm-0f3c9a/0123abcd"
	return p
}

func TestTheSeedInstallsATimerThatRenewsTheHostCertificate(t *testing.T) {
	p := withHostCertURL(t)
	ud, files := readUserData(t, seed.UserData(p))
	script := files[seed.HostCertScript]
	require.NotNil(t, script, "the renewal script")
	assert.Equal(t, "0700", script["permissions"], "its URL carries the VM's token: root's alone")
	assert.Contains(t, script["content"], "\nURL = \""+p.HostCertURL+"\"\n")
	require.Contains(t, files, seed.HostCertUnitPath)
	assert.Contains(t, files[seed.HostCertUnitPath]["content"], "\nExecStart=/usr/bin/python3 "+seed.HostCertScript+"\n")
	require.Contains(t, files, seed.HostCertTimerPath)
	timer := files[seed.HostCertTimerPath]["content"].(string)
	assert.Contains(t, timer, "\nOnBootSec=", "after every boot")
	assert.Contains(t, timer, "\nOnUnitActiveSec=6h\n", "and every few hours while it runs")
	assert.Equal(t, []any{
		[]any{"systemctl", "enable", seed.PhoneHomeUnit},
		[]any{"systemctl", "start", "--no-block", seed.PhoneHomeUnit},
		[]any{"systemctl", "enable", seed.HostCertTimer},
		[]any{"systemctl", "start", "--no-block", seed.HostCertTimer},
	}, ud["runcmd"])
	// No certificate yet (its agent could not have one made in time): sshd
	// is told where the renewal will put it all the same.
	require.Contains(t, files, seed.SSHDConfigPath)
	assert.Contains(t, files[seed.SSHDConfigPath]["content"], "\nHostCertificate "+seed.HostCertificatePath+"\n")
	assert.NotContains(t, files, seed.HostCertificatePath)

	bad := p
	bad.HostCertURL = "http://10.77.0.1:7480/x\"\nimport os"
	assert.ErrorIs(t, bad.Validate(), seed.ErrInvalidParams)
	bad = p
	bad.HostPrivKey, bad.HostPubKey = "", ""
	assert.ErrorIs(t, bad.Validate(), seed.ErrInvalidParams, "a certificate URL without a host key to certify")
}

func TestTheRenewalUnitAndTimerVerify(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed (Debian: systemd)")
	}
	if _, err := os.Stat("/usr/bin/python3"); err != nil {
		t.Skip("systemd-analyze verify needs the unit's /usr/bin/python3")
	}
	_, files := readUserData(t, seed.UserData(withHostCertURL(t)))
	dir := t.TempDir()
	unit, timer := filepath.Join(dir, seed.HostCertUnit), filepath.Join(dir, seed.HostCertTimer)
	require.NoError(t, os.WriteFile(unit, []byte(files[seed.HostCertUnitPath]["content"].(string)), 0o644))
	require.NoError(t, os.WriteFile(timer, []byte(files[seed.HostCertTimerPath]["content"].(string)), 0o644))
	out, err := exec.Command(sa, "verify", unit, timer).CombinedOutput()
	assert.NoError(t, err, "%s", out)
	assert.Empty(t, strings.TrimSpace(string(out)), "systemd has no complaint")
}

// TestTheRenewalScriptInstallsOnlyACertificateForTheGuestsKey runs the
// seed's renewal script with the host's python3 against a real endpoint,
// its paths moved into a temporary directory and its sshd reload into a
// marker file.
func TestTheRenewalScriptInstallsOnlyACertificateForTheGuestsKey(t *testing.T) {
	if _, err := exec.LookPath("python3"); err != nil {
		t.Skip("python3 not installed")
	}
	p := withHostCertURL(t)
	_, otherPub := hostKey(t)
	first, _ := certify(t, p.HostPubKey, ssh.HostCert)
	renewed, _ := certify(t, p.HostPubKey, ssh.HostCert)
	foreign, _ := certify(t, otherPub, ssh.HostCert)
	userCert, _ := certify(t, p.HostPubKey, ssh.UserCert)

	var mu sync.Mutex
	serve := "" // "": 404, as the agent answers without a certificate
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		if r.Method != http.MethodGet || r.URL.Path != "/eitri/host-cert/vm-0f3c9a/0123abcd" || serve == "" {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write([]byte(serve + "\n"))
	}))
	defer srv.Close()
	p.HostCertURL = srv.URL + "/eitri/host-cert/vm-0f3c9a/0123abcd"
	_, files := readUserData(t, seed.UserData(p))

	dir := t.TempDir()
	certPath, keyPath, reloads := filepath.Join(dir, "cert.pub"), filepath.Join(dir, "host.pub"), filepath.Join(dir, "reloads")
	require.NoError(t, os.WriteFile(keyPath, []byte(p.HostPubKey+"\n"), 0o644))
	require.NoError(t, os.WriteFile(certPath, []byte(first+"\n"), 0o644))
	script := files[seed.HostCertScript]["content"].(string)
	for from, to := range map[string]string{
		`(?m)^CERT = .*$`:           `CERT = "` + certPath + `"`,
		`(?m)^HOST_KEY = .*$`:       `HOST_KEY = "` + keyPath + `"`,
		`(?ms)^RELOAD = \[.*?\]\]$`: `RELOAD = [["sh", "-c", "echo reload >> ` + reloads + `"]]`,
	} {
		re := regexp.MustCompile(from)
		require.True(t, re.MatchString(script), "the script has %s", from)
		script = re.ReplaceAllString(script, to)
	}
	path := filepath.Join(dir, "host-cert")
	require.NoError(t, os.WriteFile(path, []byte(script), 0o700))
	run := func(cert string) (string, error) {
		mu.Lock()
		serve = cert
		mu.Unlock()
		out, err := exec.Command("python3", path).CombinedOutput()
		return string(out), err
	}
	installed := func() string {
		b, err := os.ReadFile(certPath)
		require.NoError(t, err)
		return string(b)
	}
	reloaded := func() int {
		b, _ := os.ReadFile(reloads)
		return strings.Count(string(b), "reload")
	}

	out, err := run("")
	assert.NoError(t, err, "no certificate on the host is no failure: %s", out)
	assert.Equal(t, first+"\n", installed(), "the one installed stays")

	out, err = run(renewed)
	require.NoError(t, err, out)
	assert.Equal(t, renewed+"\n", installed(), "the renewal is installed")
	assert.Equal(t, 1, reloaded(), "and sshd reloaded to present it")

	out, err = run(renewed)
	require.NoError(t, err, out)
	assert.Equal(t, 1, reloaded(), "the same certificate again changes nothing")

	for name, cert := range map[string]string{"another key's": foreign, "a user certificate": userCert, "a plain key": p.HostPubKey} {
		out, err = run(cert)
		assert.Error(t, err, "%s is refused: %s", name, out)
		assert.Equal(t, renewed+"\n", installed(), "%s leaves the installed certificate alone", name)
	}
	assert.Equal(t, 1, reloaded())
	info, err := os.Stat(certPath)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o644), info.Mode().Perm(), "sshd and clients may read it")
}
