// Package deptest checks a layer's dependency rules against the real build
// graph (`go list`), so a rule nobody remembers still fails the build when
// it is broken. Each layer keeps its own rules, each with its reason, in a
// deps_test.go beside its code; this package only reads the graph.
package deptest

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
)

// Module is eitri's module path; rules name packages under it.
const Module = "github.com/a73x/eitri"

// Rules are one layer's dependency rules.
type Rules struct {
	// Packages are the packages held to the rules: go list patterns
	// relative to the module root ("./agent/...").
	Packages []string
	// BadDeps are what Packages must not depend on, directly or through
	// any other package, each with the reason why: an import path, or a
	// tree ("github.com/a73x/eitri/server/...").
	BadDeps map[string]string
	// Only, when set, are the only eitri packages or trees Packages may
	// depend on besides their own (the trees Packages names); OnlyWhy says
	// why.
	Only    []string
	OnlyWhy string
	// StdlibOnly, when set, is why Packages depend on nothing outside the
	// standard library and eitri.
	StdlibOnly string
	// Tests holds the packages' tests to the rules as well, on what they
	// import themselves. Tests may always use test helpers (eitri packages
	// named *test), which exist to serve them.
	Tests bool
}

// Check fails t for each dependency that breaks r, naming the import chain
// that brings it in and the rule's reason.
func (r Rules) Check(t testing.TB) {
	t.Helper()
	if len(r.Packages) == 0 {
		t.Fatal("deptest: Rules name no packages")
	}
	known, err := modulePackages()
	if err != nil {
		t.Fatalf("deptest: %v", err)
	}
	for _, name := range append(slices.Collect(maps.Keys(r.BadDeps)), r.Only...) {
		if !slices.ContainsFunc(known, func(p string) bool { return matches(p, name) }) {
			t.Errorf("deptest: the rule on %s names no package in the module: a rule on a package that moved guards nothing", name)
		}
	}
	graph, err := list(append([]string{"-deps"}, r.Packages...)...)
	if err != nil {
		t.Fatalf("deptest: %v", err)
	}
	own := r.ownTrees()
	var roots []*Package
	for _, p := range graph {
		if !p.DepOnly {
			roots = append(roots, p)
		}
	}
	if len(roots) == 0 {
		t.Fatalf("deptest: %v matches no package", r.Packages)
	}
	slices.SortFunc(roots, func(a, b *Package) int { return strings.Compare(a.ImportPath, b.ImportPath) })
	for _, p := range roots {
		for _, d := range p.Deps {
			if why, bad := r.bad(d, own); bad {
				t.Errorf("%s depends on %s (%s): %s", p.ImportPath, d, chain(graph, p.ImportPath, d), why)
			}
		}
		if !r.Tests {
			continue
		}
		for _, d := range append(slices.Clone(p.TestImports), p.XTestImports...) {
			if TestHelper(d) || d == p.ImportPath {
				continue
			}
			if why, bad := r.bad(d, own); bad {
				t.Errorf("tests of %s import %s: %s", p.ImportPath, d, why)
			}
		}
	}
}

// TestHelper says whether path is an eitri package that exists to serve
// tests (netnstest, hosttest, deptest, ...).
func TestHelper(path string) bool {
	return strings.HasPrefix(path, Module+"/") && strings.HasSuffix(path, "test")
}

// bad says whether depending on d breaks r, and why.
func (r Rules) bad(d string, own []string) (string, bool) {
	for _, o := range own {
		if matches(d, o) {
			return "", false
		}
	}
	for name, why := range r.BadDeps {
		if matches(d, name) {
			return why, true
		}
	}
	if r.StdlibOnly != "" && !strings.HasPrefix(d, Module+"/") && strings.Contains(strings.Split(d, "/")[0], ".") {
		return r.StdlibOnly, true
	}
	if len(r.Only) > 0 && strings.HasPrefix(d, Module+"/") {
		for _, ok := range r.Only {
			if matches(d, ok) {
				return "", false
			}
		}
		return r.OnlyWhy, true
	}
	return "", false
}

// ownTrees are the trees r.Packages names, as import paths.
func (r Rules) ownTrees() []string {
	own := make([]string, len(r.Packages))
	for i, p := range r.Packages {
		own[i] = Module + "/" + strings.TrimPrefix(strings.TrimPrefix(p, "."), "/")
		if own[i] == Module+"/" {
			own[i] = Module
		}
	}
	return own
}

// matches says whether the import path p is name, or lies in the tree name
// ends in "/..." for.
func matches(p, name string) bool {
	if tree, ok := strings.CutSuffix(name, "/..."); ok {
		return p == tree || strings.HasPrefix(p, tree+"/")
	}
	return p == name
}

// chain is the shortest import path from root to dep, as "a → b → c".
func chain(graph map[string]*Package, root, dep string) string {
	prev := map[string]string{root: ""}
	queue := []string{root}
	for len(queue) > 0 {
		cur := queue[0]
		queue = queue[1:]
		if cur == dep {
			var path []string
			for p := dep; p != ""; p = prev[p] {
				path = append(path, p)
			}
			slices.Reverse(path)
			return strings.Join(path, " → ")
		}
		if p, ok := graph[cur]; ok {
			for _, next := range p.Imports {
				if _, seen := prev[next]; !seen {
					prev[next] = cur
					queue = append(queue, next)
				}
			}
		}
	}
	return "imported by " + root
}

// Package is what go list says of one package.
type Package struct {
	ImportPath   string
	DepOnly      bool
	Imports      []string
	Deps         []string
	TestImports  []string
	XTestImports []string
	Error        *struct{ Err string }
}

// list runs `go list -json` with args at the module root.
func list(args ...string) (map[string]*Package, error) {
	root, err := moduleRoot()
	if err != nil {
		return nil, err
	}
	cmd := exec.Command("go", append([]string{"list", "-e", "-json"}, args...)...)
	cmd.Dir = root
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, errors.New("go list: " + err.Error() + ": " + stderr.String())
	}
	pkgs := map[string]*Package{}
	dec := json.NewDecoder(bytes.NewReader(out))
	for {
		var p Package
		if err := dec.Decode(&p); err == io.EOF {
			break
		} else if err != nil {
			return nil, err
		}
		if p.Error != nil {
			return nil, errors.New(p.ImportPath + ": " + p.Error.Err)
		}
		pkgs[p.ImportPath] = &p
	}
	return pkgs, nil
}

var moduleRoot = sync.OnceValues(func() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", err
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == "/dev/null" {
		return "", errors.New("not inside eitri's module")
	}
	return filepath.Dir(mod), nil
})

// modulePackages are every package in the module, tests' helpers included.
var modulePackages = sync.OnceValues(func() ([]string, error) {
	pkgs, err := list("./...")
	if err != nil {
		return nil, err
	}
	return slices.Sorted(maps.Keys(pkgs)), nil
})
