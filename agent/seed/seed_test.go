package seed_test

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"encoding/pem"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/agent/seed"
	"github.com/a73x/eitri/agent/seed/seedtest"
)

// hostKey returns a fresh ed25519 pair in the OpenSSH formats the agent uses.
func hostKey(t *testing.T) (priv, pub string) {
	t.Helper()
	pk, sk, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	block, err := ssh.MarshalPrivateKey(sk, "")
	require.NoError(t, err)
	sshPub, err := ssh.NewPublicKey(pk)
	require.NoError(t, err)
	return string(pem.EncodeToMemory(block)), strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sshPub))) + " host@test"
}

func userKey(t *testing.T) string {
	t.Helper()
	pk, _, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	sshPub, err := ssh.NewPublicKey(pk)
	require.NoError(t, err)
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sshPub))) + " alice@laptop"
}

func validParams(t *testing.T) seed.Params {
	priv, pub := hostKey(t)
	return seed.Params{
		InstanceID:       "vm-0f3c9a",
		Hostname:         "web-1",
		SSHAuthorizedKey: userKey(t),
		HostPrivKey:      priv,
		HostPubKey:       pub,
		LoginUser:        "eitri",
		PhoneHomeURL:     "http://10.77.0.1:7480/eitri/phone-home/vm-0f3c9a/0123abcd",
	}
}

func TestWriteRoundTrip(t *testing.T) {
	p := validParams(t)
	out := filepath.Join(t.TempDir(), "seed.iso")
	require.NoError(t, seed.Write(out, p))

	label, files := seedtest.Read(t, out)
	assert.Equal(t, "cidata", label)
	require.Contains(t, files, "meta-data")
	require.Contains(t, files, "user-data")
	assert.Len(t, files, 2, "the seed holds meta-data and user-data only")

	assert.Equal(t, "instance-id: \"vm-0f3c9a\"\nlocal-hostname: \"web-1\"\n", files["meta-data"])
	ud := files["user-data"]
	assert.True(t, strings.HasPrefix(ud, "#cloud-config\n"), "cloud-init only reads user-data as config behind this header")
	assert.Contains(t, ud, "hostname: \"web-1\"\n")
	assert.Contains(t, ud, "manage_etc_hosts: true\n")
	assert.Contains(t, ud, "\nssh_authorized_keys:\n  - \""+p.SSHAuthorizedKey+"\"\n")
	assert.Contains(t, ud, "  - name: \"eitri\"\n")
	assert.NotContains(t, ud, "phone_home", "cloud-init's phone_home warns about every host key type the seed leaves out")
	assert.Contains(t, ud, "  - path: "+seed.PhoneHomeUnitPath+"\n")
	assert.Contains(t, ud, "\n      "+seed.PhoneHomeURLPrefix+"\""+p.PhoneHomeURL+"\"\n", "the script names the URL on the line the test guest looks for")
	assert.Contains(t, ud, "runcmd:\n  - [\"systemctl\", \"enable\", \""+seed.PhoneHomeUnit+"\"]\n")
	assert.Contains(t, ud, "ssh_deletekeys: true\n")
	assert.Contains(t, ud, "  ed25519_private: |\n    -----BEGIN OPENSSH PRIVATE KEY-----\n")
	assert.Contains(t, ud, "  ed25519_public: \""+p.HostPubKey+"\"\n")

	info, err := os.Stat(out)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), info.Mode().Perm(), "the seed carries a private key")
}

func TestWriteReplacesAtomically(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "seed.iso")
	p := validParams(t)
	require.NoError(t, seed.Write(out, p))
	p.InstanceID = "vm-second"
	require.NoError(t, seed.Write(out, p))

	_, files := seedtest.Read(t, out)
	assert.Contains(t, files["meta-data"], "vm-second")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	require.Len(t, entries, 1, "no temporary file is left beside the seed")
	assert.Equal(t, "seed.iso", entries[0].Name())
}

func TestWriteWithoutOptionalKeys(t *testing.T) {
	out := filepath.Join(t.TempDir(), "seed.iso")
	require.NoError(t, seed.Write(out, seed.Params{InstanceID: "i-1", Hostname: "bare"}))
	_, files := seedtest.Read(t, out)
	ud := files["user-data"]
	assert.NotContains(t, ud, "ssh_authorized_keys")
	assert.NotContains(t, ud, "ssh_keys")
	assert.NotContains(t, ud, "users:")
	assert.NotContains(t, ud, "phone_home")
	assert.NotContains(t, ud, "write_files")
	assert.NotContains(t, ud, "runcmd")
	assert.Contains(t, ud, "hostname: \"bare\"\n")
	assert.Contains(t, ud, "manage_etc_hosts: true\n")
}

func TestWriteRejectsBadParams(t *testing.T) {
	good := validParams(t)
	otherPriv, _ := hostKey(t)
	_, otherPub := hostKey(t)
	rsaLike := "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ== x"

	cases := []struct {
		name   string
		mutate func(*seed.Params)
	}{
		{"empty instance id", func(p *seed.Params) { p.InstanceID = "" }},
		{"newline in instance id", func(p *seed.Params) { p.InstanceID = "a\nb: c" }},
		{"empty hostname", func(p *seed.Params) { p.Hostname = "" }},
		{"hostname with dot", func(p *seed.Params) { p.Hostname = "web.example" }},
		{"hostname with space", func(p *seed.Params) { p.Hostname = "web 1" }},
		{"hostname leading hyphen", func(p *seed.Params) { p.Hostname = "-web" }},
		{"hostname trailing hyphen", func(p *seed.Params) { p.Hostname = "web-" }},
		{"hostname too long", func(p *seed.Params) { p.Hostname = strings.Repeat("a", 64) }},
		{"hostname with newline", func(p *seed.Params) { p.Hostname = "web\nruncmd: [x]" }},
		{"authorized key with newline", func(p *seed.Params) { p.SSHAuthorizedKey += "\nssh_deletekeys: false" }},
		{"authorized key garbage", func(p *seed.Params) { p.SSHAuthorizedKey = "not a key" }},
		{"private key without public", func(p *seed.Params) { p.HostPubKey = "" }},
		{"public key without private", func(p *seed.Params) { p.HostPrivKey = "" }},
		{"public key with newline", func(p *seed.Params) { p.HostPubKey += "\nx" }},
		{"private key garbage", func(p *seed.Params) {
			p.HostPrivKey = "-----BEGIN OPENSSH PRIVATE KEY-----\nzz\n-----END OPENSSH PRIVATE KEY-----\n"
		}},
		{"private key with carriage return", func(p *seed.Params) { p.HostPrivKey = strings.ReplaceAll(p.HostPrivKey, "\n", "\r\n") }},
		{"mismatched private", func(p *seed.Params) { p.HostPrivKey = otherPriv }},
		{"mismatched public", func(p *seed.Params) { p.HostPubKey = otherPub }},
		{"public key not ed25519", func(p *seed.Params) { p.HostPubKey = rsaLike }},
		{"login user root", func(p *seed.Params) { p.LoginUser = "root" }},
		{"login user upper case", func(p *seed.Params) { p.LoginUser = "Eitri" }},
		{"login user leading digit", func(p *seed.Params) { p.LoginUser = "1user" }},
		{"login user leading hyphen", func(p *seed.Params) { p.LoginUser = "-user" }},
		{"login user with newline", func(p *seed.Params) { p.LoginUser = "eitri\nsudo: x" }},
		{"login user too long", func(p *seed.Params) { p.LoginUser = strings.Repeat("a", 33) }},
		{"phone home not http", func(p *seed.Params) { p.PhoneHomeURL = "ftp://10.77.0.1/x" }},
		{"phone home no host", func(p *seed.Params) { p.PhoneHomeURL = "http:///x" }},
		{"phone home with quote", func(p *seed.Params) { p.PhoneHomeURL = "http://10.77.0.1/x';reboot;'" }},
		{"phone home with credentials", func(p *seed.Params) { p.PhoneHomeURL = "http://u:p@10.77.0.1/x" }},
		{"phone home with space", func(p *seed.Params) { p.PhoneHomeURL = "http://10.77.0.1/a b" }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := good
			tc.mutate(&p)
			dir := t.TempDir()
			err := seed.Write(filepath.Join(dir, "seed.iso"), p)
			require.Error(t, err)
			assert.True(t, errors.Is(err, seed.ErrInvalidParams), "got %v", err)
			entries, rerr := os.ReadDir(dir)
			require.NoError(t, rerr)
			assert.Empty(t, entries, "a rejected seed writes nothing")
		})
	}
}

func TestValidHostnames(t *testing.T) {
	for _, h := range []string{"a", "web-1", "WEB1", "0123", "on", "null", strings.Repeat("a", 63)} {
		t.Run(h, func(t *testing.T) {
			assert.NoError(t, seed.Params{InstanceID: "i", Hostname: h}.Validate())
		})
	}
}

// TestYAMLParsesAsIntended reads the documents back with PyYAML's safe loader,
// the parser cloud-init itself uses, so quoting mistakes show up as wrong
// values rather than as a guest that quietly ignores its config.
func TestYAMLParsesAsIntended(t *testing.T) {
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed; cannot cross-check YAML with PyYAML")
	}
	if exec.Command(py, "-c", "import yaml").Run() != nil {
		t.Skip("python3 has no yaml module (Debian: python3-yaml)")
	}
	p := validParams(t)
	p.Hostname = "on" // a YAML 1.1 boolean when left bare
	p.InstanceID = `id: with "quotes" and \ backslash # not a comment`

	load := func(doc string) map[string]any {
		cmd := exec.Command(py, "-c", "import sys, json, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)")
		cmd.Stdin = strings.NewReader(doc)
		var out, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &stderr
		require.NoError(t, cmd.Run(), stderr.String())
		var m map[string]any
		require.NoError(t, json.Unmarshal(out.Bytes(), &m))
		return m
	}

	md := load(seed.MetaData(p))
	assert.Equal(t, map[string]any{"instance-id": p.InstanceID, "local-hostname": "on"}, md)

	ud := load(seed.UserData(p))
	assert.Equal(t, "on", ud["hostname"])
	assert.Equal(t, []any{p.SSHAuthorizedKey}, ud["ssh_authorized_keys"])
	assert.Equal(t, true, ud["ssh_deletekeys"])
	keys, ok := ud["ssh_keys"].(map[string]any)
	require.True(t, ok, "ssh_keys is a mapping: %#v", ud["ssh_keys"])
	assert.Equal(t, p.HostPrivKey, keys["ed25519_private"], "the private key survives byte for byte")
	assert.Equal(t, p.HostPubKey, keys["ed25519_public"])
	assert.Equal(t, true, ud["manage_etc_hosts"])

	assert.Equal(t, []any{"default", map[string]any{
		"name": "eitri", "gecos": "eitri login user", "sudo": "ALL=(ALL) NOPASSWD:ALL",
		"lock_passwd": true, "ssh_authorized_keys": []any{p.SSHAuthorizedKey},
	}}, ud["users"])
	assert.NotContains(t, ud, "phone_home")

	files, ok := ud["write_files"].([]any)
	require.True(t, ok, "write_files is a list: %#v", ud["write_files"])
	byPath := map[string]map[string]any{}
	for _, f := range files {
		entry := f.(map[string]any)
		byPath[entry["path"].(string)] = entry
	}
	require.Len(t, byPath, 2, "the phone-home script and its unit")
	script := byPath[seed.PhoneHomeScript]
	require.NotNil(t, script, "the phone-home script")
	assert.Equal(t, "0700", script["permissions"], "its URL carries the VM's token: root's alone")
	content := script["content"].(string)
	assert.True(t, strings.HasPrefix(content, "#!/usr/bin/python3\n"))
	assert.Contains(t, content, "\n"+seed.PhoneHomeURLPrefix+"\""+p.PhoneHomeURL+"\"\n")
	unit := byPath[seed.PhoneHomeUnitPath]
	require.NotNil(t, unit, "the phone-home unit")
	assert.Equal(t, "0644", unit["permissions"])
	assert.Contains(t, unit["content"], "\nAfter=cloud-final.service ", "it phones home once cloud-init is done")
	assert.Contains(t, unit["content"], "\nExecStart=/usr/bin/python3 "+seed.PhoneHomeScript+"\n")
	assert.Equal(t, []any{
		[]any{"systemctl", "enable", seed.PhoneHomeUnit},
		[]any{"systemctl", "start", "--no-block", seed.PhoneHomeUnit},
	}, ud["runcmd"], "enabled for later boots, started for this one without waiting on cloud-final, which runs runcmd")
}

// phoneHomeFiles returns the script and unit the seed for p writes, read
// back with PyYAML.
func phoneHomeFiles(t *testing.T, p seed.Params) (script, unit string) {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed")
	}
	if exec.Command(py, "-c", "import yaml").Run() != nil {
		t.Skip("python3 has no yaml module (Debian: python3-yaml)")
	}
	cmd := exec.Command(py, "-c", `import sys, json, yaml
files = {f["path"]: f["content"] for f in yaml.safe_load(sys.stdin)["write_files"]}
json.dump([files[sys.argv[1]], files[sys.argv[2]]], sys.stdout)`, seed.PhoneHomeScript, seed.PhoneHomeUnitPath)
	cmd.Stdin = strings.NewReader(seed.UserData(p))
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	require.NoError(t, cmd.Run(), stderr.String())
	var both []string
	require.NoError(t, json.Unmarshal(out.Bytes(), &both))
	return both[0], both[1]
}

// TestPhoneHomeScriptPosts runs the seed's phone-home script with the
// host's python3 against a real endpoint: it posts to the URL, and tries
// again when the endpoint fails.
func TestPhoneHomeScriptPosts(t *testing.T) {
	var mu sync.Mutex
	var posts []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		assert.NoError(t, r.ParseForm())
		posts = append(posts, r.Method+" "+r.URL.Path+" instance_id="+r.PostForm.Get("instance_id"))
		if len(posts) == 1 {
			http.Error(w, "not yet", http.StatusServiceUnavailable)
		}
	}))
	defer srv.Close()
	p := validParams(t)
	p.PhoneHomeURL = srv.URL + "/eitri/phone-home/vm-0f3c9a/0123abcd"
	script, _ := phoneHomeFiles(t, p)
	path := filepath.Join(t.TempDir(), "phone-home")
	require.NoError(t, os.WriteFile(path, []byte(script), 0o700))

	out, err := exec.Command("python3", path).CombinedOutput()
	require.NoError(t, err, "%s", out)
	mu.Lock()
	defer mu.Unlock()
	// Outside a guest there is no cloud-init instance id to send.
	want := "POST /eitri/phone-home/vm-0f3c9a/0123abcd instance_id="
	assert.Equal(t, []string{want, want}, posts, "a failed post is tried again, a successful one is the last")
	assert.Contains(t, string(out), "phoned home (attempt 2)")
}

// TestPhoneHomeUnitVerifies has systemd check the unit, when
// systemd-analyze is installed.
func TestPhoneHomeUnitVerifies(t *testing.T) {
	sa, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed (Debian: systemd)")
	}
	if _, err := os.Stat("/usr/bin/python3"); err != nil {
		t.Skip("systemd-analyze verify needs the unit's /usr/bin/python3")
	}
	_, unit := phoneHomeFiles(t, validParams(t))
	path := filepath.Join(t.TempDir(), seed.PhoneHomeUnit)
	require.NoError(t, os.WriteFile(path, []byte(unit), 0o644))
	out, err := exec.Command(sa, "verify", path).CombinedOutput()
	assert.NoError(t, err, "%s", out)
	assert.Empty(t, strings.TrimSpace(string(out)), "systemd has no complaint")
}

// TestSystemToolsSeeTheLabel checks the image with the tools a Linux host and
// guest use to find a NoCloud seed, when they are installed.
func TestSystemToolsSeeTheLabel(t *testing.T) {
	out := filepath.Join(t.TempDir(), "seed.iso")
	require.NoError(t, seed.Write(out, validParams(t)))

	t.Run("blkid", func(t *testing.T) {
		blkid, err := exec.LookPath("blkid")
		if err != nil {
			t.Skip("blkid not installed (Debian: util-linux)")
		}
		got, err := exec.Command(blkid, "-p", "-o", "export", out).Output()
		require.NoError(t, err)
		assert.Contains(t, string(got), "TYPE=iso9660")
		assert.Contains(t, string(got), "LABEL=cidata")
	})
	t.Run("isoinfo", func(t *testing.T) {
		isoinfo, err := exec.LookPath("isoinfo")
		if err != nil {
			t.Skip("isoinfo not installed (Debian: genisoimage)")
		}
		got, err := exec.Command(isoinfo, "-d", "-i", out).Output()
		require.NoError(t, err)
		assert.Contains(t, string(got), "Volume id: cidata")
		listing, err := exec.Command(isoinfo, "-f", "-i", out).Output()
		require.NoError(t, err)
		assert.Contains(t, strings.ToLower(string(listing)), "/meta-data;1")
		assert.Contains(t, strings.ToLower(string(listing)), "/user-data;1")
	})
}

// certify signs pub (authorized_keys form) with a fresh CA as a certificate
// of type typ, returning the certificate line and the CA's key line.
func certify(t *testing.T, pub string, typ uint32) (cert, ca string) {
	t.Helper()
	_, caPriv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	signer, err := ssh.NewSignerFromKey(caPriv)
	require.NoError(t, err)
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(pub))
	require.NoError(t, err)
	c := &ssh.Certificate{Key: k, CertType: typ, ValidPrincipals: []string{"vm-0f3c9a", "web-1"}, ValidBefore: ssh.CertTimeInfinity}
	require.NoError(t, c.SignCert(rand.Reader, signer))
	return strings.TrimSpace(string(ssh.MarshalAuthorizedKey(c))), strings.TrimSpace(string(ssh.MarshalAuthorizedKey(signer.PublicKey())))
}

// readUserData reads a user-data document with PyYAML, as cloud-init
// does: the document, and its write_files by path.
func readUserData(t *testing.T, doc string) (ud map[string]any, files map[string]map[string]any) {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil || exec.Command(py, "-c", "import yaml").Run() != nil {
		t.Skip("python3 with PyYAML is needed to read the seed as cloud-init does")
	}
	cmd := exec.Command(py, "-c", "import sys, json, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)")
	cmd.Stdin = strings.NewReader(doc)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	require.NoError(t, cmd.Run(), stderr.String())
	require.NoError(t, json.Unmarshal(out.Bytes(), &ud))
	files = map[string]map[string]any{}
	for _, f := range ud["write_files"].([]any) {
		m := f.(map[string]any)
		files[m["path"].(string)] = m
	}
	return ud, files
}

func TestSeedTrustsTheUserCAAndPresentsTheHostCertificate(t *testing.T) {
	p := validParams(t)
	hostCert, _ := certify(t, p.HostPubKey, ssh.HostCert)
	_, userCA := certify(t, p.HostPubKey, ssh.UserCert)
	_, previousCA := certify(t, p.HostPubKey, ssh.UserCert)
	p.HostCertificate = hostCert
	p.TrustedUserCAKeys = []string{userCA, previousCA}
	p.UserCertPrincipal = p.LoginUser + "@" + p.InstanceID
	out := filepath.Join(t.TempDir(), "seed.iso")
	require.NoError(t, seed.Write(out, p))
	_, isoFiles := seedtest.Read(t, out)
	ud, files := readUserData(t, isoFiles["user-data"])
	require.Contains(t, files, seed.PhoneHomeScript, "the phone-home script is still written")
	require.Contains(t, files, seed.PhoneHomeUnitPath, "and its unit")
	require.Contains(t, files, seed.UserCAKeysPath)
	assert.Equal(t, userCA+"\n"+previousCA+"\n", files[seed.UserCAKeysPath]["content"], "every trusted CA key, one a line")
	require.Contains(t, files, seed.HostCertificatePath)
	assert.Equal(t, hostCert+"\n", files[seed.HostCertificatePath]["content"])
	require.Contains(t, files, seed.SSHDConfigPath)
	conf := files[seed.SSHDConfigPath]["content"].(string)
	assert.Contains(t, conf, "\nTrustedUserCAKeys "+seed.UserCAKeysPath+"\n")
	assert.Contains(t, conf, "\nHostCertificate "+seed.HostCertificatePath+"\n")
	assert.Contains(t, conf, "\nAuthorizedPrincipalsFile "+seed.PrincipalsDir+"/%u\n",
		"sshd takes a certificate for this guest's principal only, not any certificate naming the user")
	require.Contains(t, files, seed.PrincipalsDir+"/"+p.LoginUser)
	assert.Equal(t, p.UserCertPrincipal+"\n", files[seed.PrincipalsDir+"/"+p.LoginUser]["content"])
	assert.Equal(t, []any{p.SSHAuthorizedKey}, ud["ssh_authorized_keys"], "the injected key still works beside the CA")
	assert.NotContains(t, seed.HostCertificatePath, "ssh_host_", "cloud-init's ssh_deletekeys would remove it")

	// Without CA material the seed writes no sshd drop-in.
	p.HostCertificate, p.TrustedUserCAKeys = "", nil
	assert.NotContains(t, seed.UserData(p), seed.SSHDConfigPath)
}

func TestSeedRefusesBadSSHCAMaterial(t *testing.T) {
	good := validParams(t)
	_, otherPub := hostKey(t)
	otherCert, ca := certify(t, otherPub, ssh.HostCert)
	userCert, _ := certify(t, good.HostPubKey, ssh.UserCert)
	for name, mutate := range map[string]func(*seed.Params){
		"host certificate for another key": func(p *seed.Params) { p.HostCertificate = otherCert },
		"user certificate as host":         func(p *seed.Params) { p.HostCertificate = userCert },
		"host certificate not a cert":      func(p *seed.Params) { p.HostCertificate = p.HostPubKey },
		"host certificate with newline":    func(p *seed.Params) { p.HostCertificate = otherCert + "\nruncmd: [x]" },
		"host certificate without key": func(p *seed.Params) {
			p.HostCertificate, p.HostPrivKey, p.HostPubKey = otherCert, "", ""
		},
		"CA key garbage":       func(p *seed.Params) { p.TrustedUserCAKeys = []string{"not a key"} },
		"CA key with newline":  func(p *seed.Params) { p.TrustedUserCAKeys = []string{ca + "\nruncmd: [x]"} },
		"CA key a certificate": func(p *seed.Params) { p.TrustedUserCAKeys = []string{otherCert} },
		"CA key without a principal": func(p *seed.Params) {
			p.TrustedUserCAKeys, p.UserCertPrincipal = []string{ca}, ""
		},
		"CA key without a login user": func(p *seed.Params) {
			p.TrustedUserCAKeys, p.LoginUser = []string{ca}, ""
		},
		"principal with a space": func(p *seed.Params) {
			p.TrustedUserCAKeys, p.UserCertPrincipal = []string{ca}, "eitri vm-1"
		},
	} {
		t.Run(name, func(t *testing.T) {
			p := good
			mutate(&p)
			assert.ErrorIs(t, p.Validate(), seed.ErrInvalidParams)
		})
	}
}
