package fleet

import (
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/assert"
)

func TestEveryKindHasItsOwnConnectCode(t *testing.T) {
	// Unavailable is the last kind; a new one must be given a code too, or
	// the API and MCP would answer it as internal.
	seen := map[connect.Code]Kind{}
	for k := Internal; k <= Unavailable; k++ {
		_, ok := codes[k]
		assert.True(t, ok, "kind %d has no code", k)
		if prev, dup := seen[k.Code()]; dup {
			t.Errorf("kinds %d and %d share %s", prev, k, k.Code())
		}
		seen[k.Code()] = k
	}
	assert.Equal(t, connect.CodeUnavailable, Unavailable.Code())
}
