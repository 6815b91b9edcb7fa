package wire_test

import (
	"testing"

	"github.com/a73x/eitri/internal/deptest"
)

func TestWireImportsOnlyTheSchema(t *testing.T) {
	deptest.Rules{
		Packages: []string{"./wire/..."},
		Only:     []string{deptest.Module + "/gen/..."},
		OnlyWhy:  "wire/ is what every side shares beyond gen/ (codecs, words, client plumbing); the control plane, the agent and the client commands all import it, so it may import none of them, or it would tie each to the others",
		Tests:    true,
	}.Check(t)
}
