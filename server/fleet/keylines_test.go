package fleet

import (
	"crypto/ed25519"
	"crypto/rand"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"

	"github.com/a73x/eitri/server/sshca"
)

func newSSHKey(t *testing.T) ssh.PublicKey {
	t.Helper()
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	k, err := ssh.NewPublicKey(pub)
	require.NoError(t, err)
	return k
}

// What keyLines keeps is what parsing anew would give, and a rotated CA's
// new key is seen as the current one at once.
func TestKeyLinesMatchParsingAnew(t *testing.T) {
	a, b := newSSHKey(t), newSSHKey(t)
	lineA, lineB := sshca.AuthorizedKey(a), sshca.AuthorizedKey(b)
	var c keyLines
	for _, tc := range []struct {
		name, line string
		key, fp    string
	}{
		{"a key", lineA, lineA, ssh.FingerprintSHA256(a)},
		{"the same key with a comment", lineA + " eitri user CA", lineA, ssh.FingerprintSHA256(a)},
		{"another key", lineB, lineB, ssh.FingerprintSHA256(b)},
		{"not a key", "ssh-ed25519 AAAAnotbase64", "ssh-ed25519 AAAAnotbase64", ""},
		{"one word", "garbage", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for range 2 { // parsed, then kept
				p := c.parse(tc.line)
				assert.Equal(t, tc.key, p.key)
				assert.Equal(t, tc.fp, p.fingerprint)
			}
		})
	}
	assert.Equal(t, lineA, c.current(a))
	assert.Equal(t, lineB, c.current(b), "after a rotation")
	assert.Equal(t, lineA, c.current(a), "and back")
}

// However many lines it is shown, it keeps a bounded number.
func TestKeyLinesStayBounded(t *testing.T) {
	var c keyLines
	for range 3 * keyLinesKept {
		c.parse(sshca.AuthorizedKey(newSSHKey(t)))
	}
	assert.LessOrEqual(t, len(c.seen), keyLinesKept)
}
