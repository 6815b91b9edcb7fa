// Package agent_test holds the tree's import rules. They live here, beside
// the building blocks they mostly guard, and read the real build graph with
// `go list`, so a rule nobody remembers still fails the build when broken.
package agent_test

import (
	"bytes"
	"encoding/json"
	"io"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const module = "github.com/a73x/eitri/"

type pkg struct {
	ImportPath   string
	Imports      []string
	TestImports  []string
	XTestImports []string
}

// listPackages runs `go list -json` on patterns (relative to the module root).
func listPackages(t *testing.T, patterns ...string) []pkg {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-json"}, patterns...)...)
	cmd.Dir = ".."
	out, err := cmd.Output()
	require.NoError(t, err, "go list %v", patterns)
	var pkgs []pkg
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p pkg
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else {
			require.NoError(t, err)
		}
		pkgs = append(pkgs, p)
	}
	require.NotEmpty(t, pkgs, "go list %v found no packages", patterns)
	return pkgs
}

// testHelpers are eitri packages that exist only to serve tests; tests of any
// package may use them.
func testHelper(path string) bool {
	return strings.HasSuffix(path, "test") // netnstest, qemutest, ...
}

// leaves are eitri packages of vocabulary alone (the permanent-error mark)
// that import only the standard library; a building block may use them and
// stay on its own.
var leaves = []string{module + "agent/permanent"}

func leaf(path string) bool {
	for _, l := range leaves {
		if path == l {
			return true
		}
	}
	return false
}

func TestBuildingBlocksImportNoOtherEitriPackage(t *testing.T) {
	// The building blocks do one job each on the host and know nothing of the
	// wire (gen/) or of each other, so each can be understood, tested and
	// replaced alone; the reconcile engine and the node compose them.
	blocks := []string{"imagecache", "exposeproxy", "qemu", "netsetup", "seed", "state"}
	for _, b := range blocks {
		t.Run(b, func(t *testing.T) {
			own := module + "agent/" + b
			for _, p := range listPackages(t, "./agent/"+b+"/...") {
				if testHelper(p.ImportPath) {
					continue
				}
				for _, imp := range p.Imports {
					if strings.HasPrefix(imp, module) && !strings.HasPrefix(imp, own) && !leaf(imp) {
						t.Errorf("%s imports %s: building blocks import nothing from gen/ or other eitri packages", p.ImportPath, imp)
					}
				}
				for _, imp := range append(p.TestImports, p.XTestImports...) {
					if strings.HasPrefix(imp, module) && !strings.HasPrefix(imp, own) && !testHelper(imp) && !leaf(imp) {
						t.Errorf("tests of %s import %s: building blocks' tests use only test helpers", p.ImportPath, imp)
					}
				}
			}
		})
	}
}

func TestLeavesImportOnlyTheStandardLibrary(t *testing.T) {
	for _, l := range leaves {
		for _, p := range listPackages(t, "./"+strings.TrimPrefix(l, module)) {
			for _, imp := range p.Imports {
				if strings.Contains(strings.Split(imp, "/")[0], ".") {
					t.Errorf("%s imports %s: a leaf every building block may use imports only the standard library", p.ImportPath, imp)
				}
			}
		}
	}
}

func TestControlPlaneAndAgentShareOnlyTheWire(t *testing.T) {
	// The control plane and the agent meet only through gen/ (the protocol)
	// and wire/ (what both sides of it must agree on): neither imports the
	// other's code, tests included.
	for _, side := range []struct{ dir, other string }{
		{"server", "agent/"},
		{"agent", "server/"},
	} {
		for _, p := range listPackages(t, "./"+side.dir+"/...") {
			for _, imp := range append(append(p.Imports, p.TestImports...), p.XTestImports...) {
				if strings.HasPrefix(imp, module+side.other) {
					t.Errorf("%s imports %s: %s code must not import %s code", p.ImportPath, imp, side.dir, strings.TrimSuffix(side.other, "/"))
				}
			}
		}
	}
}

func TestWireImportsOnlyTheSchema(t *testing.T) {
	// wire/ is what every side shares beyond gen/ (codecs, words, client
	// plumbing); the server, the agent and the clients all import it, so it
	// may import none of them, tests included.
	for _, p := range listPackages(t, "./wire/...") {
		for _, imp := range append(append(p.Imports, p.TestImports...), p.XTestImports...) {
			if strings.HasPrefix(imp, module) && !strings.HasPrefix(imp, module+"gen/") && !strings.HasPrefix(imp, module+"wire/") {
				t.Errorf("%s imports %s: wire/ imports only gen/ and other wire/ packages from eitri", p.ImportPath, imp)
			}
		}
	}
}
