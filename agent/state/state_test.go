package state

import (
	"crypto/ed25519"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
)

func open(t *testing.T) *Store {
	t.Helper()
	s, err := Open(t.TempDir())
	require.NoError(t, err)
	return s
}

// tempFiles lists every file under the store that is a write in progress.
func tempFiles(t *testing.T, s *Store) []string {
	t.Helper()
	var found []string
	require.NoError(t, filepath.WalkDir(s.Dir(), func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if strings.HasPrefix(d.Name(), tmpPrefix) {
			found = append(found, p)
		}
		return nil
	}))
	return found
}

func TestIdentityRoundTrip(t *testing.T) {
	s := open(t)
	_, ok, err := s.LoadIdentity()
	require.NoError(t, err)
	assert.False(t, ok, "a fresh store has no identity")

	want := Identity{HostID: "h1", Credential: "secret", ServerURL: "https://cp:8443", Fingerprint: strings.Repeat("ab", 32)}
	require.NoError(t, s.SaveIdentity(want))

	// A second Store on the same directory proves it reached the disk.
	s2, err := Open(s.Dir())
	require.NoError(t, err)
	got, ok, err := s2.LoadIdentity()
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, want, got)
	assert.Len(t, got.Fingerprint, 64)

	// Enrolled hosts' files name the pin CertFingerprint; they must still
	// read after an upgrade.
	raw, err := os.ReadFile(filepath.Join(s.Dir(), identityFile))
	require.NoError(t, err)
	assert.Contains(t, string(raw), `"CertFingerprint": "`+want.Fingerprint+`"`)
}

func TestVMRecordRoundTrip(t *testing.T) {
	s := open(t)
	now := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	want := Record{
		Spec:           VMSpec{ID: "vm-1", Name: "web-1", ImageURL: "http://x/img", ImageSHA256: strings.Repeat("a", 64), VCPUs: 2, MemMB: 512, DiskGB: 10, SSHAuthorizedKey: "ssh-ed25519 AAA user", Owner: "user-7"},
		BootID:         "b1",
		IP:             "10.0.0.5",
		HostPubKey:     "pub",
		HostPrivKey:    "priv",
		CreateAttempts: 2,
		LastError:      "boom",
		Failed:         true,
		QuarantinedAt:  now,
		DestroyAt:      now.Add(time.Hour),
	}
	require.NoError(t, s.SaveVM("vm-1", want))
	got, ok, err := s.LoadVM("vm-1")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, want.Spec, got.Spec)
	assert.True(t, want.QuarantinedAt.Equal(got.QuarantinedAt))
	assert.True(t, want.DestroyAt.Equal(got.DestroyAt))
	got.QuarantinedAt, got.DestroyAt, want.QuarantinedAt, want.DestroyAt = time.Time{}, time.Time{}, time.Time{}, time.Time{}
	assert.Equal(t, want, got)

	// Zero times survive as zero.
	require.NoError(t, s.SaveVM("vm-2", Record{Spec: VMSpec{ID: "vm-2"}}))
	got, ok, err = s.LoadVM("vm-2")
	require.NoError(t, err)
	require.True(t, ok)
	assert.True(t, got.QuarantinedAt.IsZero())
	assert.True(t, got.DestroyAt.IsZero())

	ids, err := s.ListVMs()
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"vm-1", "vm-2"}, ids)
}

// A record written before VMs had owners reads as owned by nobody, which
// the agent takes as "isolate this guest".
func TestRecordFromBeforeOwnersReadsAsNoOwner(t *testing.T) {
	s := open(t)
	old := `{"Spec":{"ID":"vm-1","Name":"web-1","ImageURL":"http://x/img","ImageSHA256":"` + strings.Repeat("a", 64) +
		`","VCPUs":1,"MemMB":256,"DiskGB":1,"SSHAuthorizedKey":""},"BootID":"b1","IP":"10.77.0.2"}`
	require.NoError(t, os.WriteFile(s.recordPath("vm-1"), []byte(old), 0o600))
	got, ok, err := s.LoadVM("vm-1")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, "web-1", got.Spec.Name)
	assert.Equal(t, "b1", got.BootID)
	assert.Empty(t, got.Spec.Owner)
}

func TestAbsentRecordIsNotAnError(t *testing.T) {
	s := open(t)
	_, ok, err := s.LoadVM("nope")
	require.NoError(t, err)
	assert.False(t, ok)
}

// A damaged record must never read as "no VM here": the engine would create a
// fresh VM on top of a live one.
func TestCorruptRecordIsAnErrorNotAbsent(t *testing.T) {
	for name, content := range map[string]string{
		"truncated":  `{"Spec":{"ID":"vm-1"`,
		"garbage":    "\x00\x01\x02",
		"empty":      "",
		"wrong type": `{"CreateAttempts":"three"}`,
	} {
		t.Run(name, func(t *testing.T) {
			s := open(t)
			require.NoError(t, os.WriteFile(s.recordPath("vm-1"), []byte(content), 0o600))
			_, ok, err := s.LoadVM("vm-1")
			require.Error(t, err)
			assert.False(t, ok)
		})
	}
}

func TestCorruptIdentityIsAnError(t *testing.T) {
	s := open(t)
	require.NoError(t, os.WriteFile(filepath.Join(s.Dir(), identityFile), []byte("{"), 0o600))
	_, _, err := s.LoadIdentity()
	require.Error(t, err)
}

func TestAtomicWritesLeaveNoTempFiles(t *testing.T) {
	s := open(t)
	for i := range 20 {
		require.NoError(t, s.SaveVM("vm-1", Record{CreateAttempts: i}))
		require.NoError(t, s.SaveIdentity(Identity{HostID: "h"}))
	}
	assert.Empty(t, tempFiles(t, s))
	got, ok, err := s.LoadVM("vm-1")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, 19, got.CreateAttempts, "the last write wins whole")

	// A write that cannot rename (target is a directory) cleans up after itself.
	require.NoError(t, os.Mkdir(s.recordPath("vm-dir"), 0o700))
	require.Error(t, s.SaveVM("vm-dir", Record{}))
	assert.Empty(t, tempFiles(t, s))
}

func TestOpenSweepsCrashLeftovers(t *testing.T) {
	s := open(t)
	stray := filepath.Join(s.Dir(), vmRecordDir, tmpPrefix+"vm-1.json-123")
	require.NoError(t, os.WriteFile(stray, []byte("half"), 0o600))

	s2, err := Open(s.Dir())
	require.NoError(t, err)
	assert.NoFileExists(t, stray)
	ids, err := s2.ListVMs()
	require.NoError(t, err)
	assert.Empty(t, ids, "a temp file is not a record")
}

func TestDeleteVMRemovesRecordAndData(t *testing.T) {
	s := open(t)
	require.NoError(t, s.SaveVM("vm-1", Record{}))
	seed := s.SeedPath("vm-1")
	require.NoError(t, os.WriteFile(seed, []byte("iso"), 0o600))
	assert.Equal(t, s.VMDir("vm-1"), filepath.Dir(seed))

	require.NoError(t, s.DeleteVM("vm-1"))
	_, ok, err := s.LoadVM("vm-1")
	require.NoError(t, err)
	assert.False(t, ok)
	assert.NoFileExists(t, seed)
	require.NoError(t, s.DeleteVM("vm-1"), "deleting twice is fine")
}

func TestInvalidIDsNeverReachTheFilesystem(t *testing.T) {
	s := open(t)
	for _, id := range []string{"", ".", "..", "../escape", "a/b", ".tmp-x", "-x", strings.Repeat("x", 65)} {
		assert.False(t, ValidID(id), id)
		require.Error(t, s.SaveVM(id, Record{}), id)
		_, _, err := s.LoadVM(id)
		require.Error(t, err, id)
		require.Error(t, s.DeleteVM(id), id)
		assert.Equal(t, filepath.Join(s.Dir(), vmDataDir), filepath.Dir(s.VMDir(id)), "VMDir stays inside the store for %q", id)
	}
	assert.True(t, ValidID("0b2c9e1a-7d4f-4a1e-9a55-3f6d2b8c1e00"))
	assert.True(t, ValidID(strings.Repeat("x", 64)))
}

func TestNewHostKey(t *testing.T) {
	pub, priv, err := NewHostKey()
	require.NoError(t, err)
	assert.True(t, strings.HasPrefix(pub, "ssh-ed25519 "))
	assert.NotContains(t, pub, "\n")
	assert.Contains(t, priv, "BEGIN OPENSSH PRIVATE KEY")

	parsedPub, _, _, _, err := ssh.ParseAuthorizedKey([]byte(pub))
	require.NoError(t, err)
	raw, err := ssh.ParseRawPrivateKey([]byte(priv))
	require.NoError(t, err)
	sk, ok := raw.(*ed25519.PrivateKey)
	require.True(t, ok, "an ed25519 key, got %T", raw)
	derived, err := ssh.NewPublicKey(sk.Public())
	require.NoError(t, err)
	assert.Equal(t, parsedPub.Marshal(), derived.Marshal(), "the halves belong together")

	pub2, _, err := NewHostKey()
	require.NoError(t, err)
	assert.NotEqual(t, pub, pub2)
}
