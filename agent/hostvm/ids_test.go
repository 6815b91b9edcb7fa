package hostvm

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/state"
)

// The engine admits a VM by state.ValidID; QEMU then builds paths from the
// same id. Were the rules to differ, an id could pass the one and fail for
// good in the other, so they are held together here, where both meet.
func TestTheStoreAndQEMUAgreeOnWhichIDsAreValid(t *testing.T) {
	for _, id := range []string{
		"vm-0b2c9e1a", "0b2c9e1a-7d4f-4a1e-9a55-3f6d2b8c1e00", "a", "A.b_c-d",
		strings.Repeat("x", 63), strings.Repeat("x", 64), strings.Repeat("x", 65), strings.Repeat("x", 128),
		"", ".", "..", ".tmp-x", "-x", "_x", "a/b", "../escape", "a b", "a,b", "ä",
	} {
		assert.Equal(t, state.ValidID(id), qemu.ValidID(id), "id %q", id)
	}
}
