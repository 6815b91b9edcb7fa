// Package gen holds the code buf generates from proto/ (gen/go, gen/ts);
// this test, outside the generated trees, keeps it standing alone.
package gen_test

import (
	"testing"

	"github.com/a73x/eitri/internal/deptest"
)

func TestTheSchemaImportsNothingOfEitri(t *testing.T) {
	deptest.Rules{
		Packages: []string{"./gen/..."},
		BadDeps: map[string]string{
			deptest.Module + "/...": "gen/ is generated from proto/ alone and every side imports it: it can depend on no side, or the protocol would change with that side's code",
		},
	}.Check(t)
}
