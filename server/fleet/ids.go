package fleet

import (
	"crypto/rand"
	"encoding/base32"
	"strings"
)

var idEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// newID returns prefix-<16 random base32 chars>: short enough to type,
// random enough never to collide.
func newID(prefix string) string {
	var b [10]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + strings.ToLower(idEncoding.EncodeToString(b[:]))
}
