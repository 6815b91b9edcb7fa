package agent_test

import (
	"testing"

	"github.com/a73x/eitri/internal/deptest"
)

const eitri = deptest.Module + "/"

// permanent is vocabulary alone (the permanent-error mark): a building block
// may use it and still stand on its own.
const permanent = eitri + "agent/permanent"

// addrpolicy is the one rule for which addresses a download may reach: the
// image cache obeys it on the host and the control plane's catalogue when it
// fetches SUMS files and images, so it lives in wire/ as a leaf.
const addrpolicy = eitri + "wire/addrpolicy"

func TestBuildingBlocksStandAlone(t *testing.T) {
	// The building blocks do one job each on the host and know nothing of
	// the wire (gen/) or of each other, so each can be understood, tested
	// and replaced alone; the reconcile engine, the node and Run compose
	// them.
	for _, b := range []string{"imagecache", "exposeproxy", "qemu", "netsetup", "seed", "state", "usage"} {
		t.Run(b, func(t *testing.T) {
			deptest.Rules{
				Packages: []string{"./agent/" + b + "/..."},
				Only:     []string{permanent, addrpolicy},
				OnlyWhy:  "a building block imports nothing from gen/ or other eitri packages; its tests use only test helpers",
				Tests:    true,
			}.Check(t)
		})
	}
}

func TestLeavesImportOnlyTheStandardLibrary(t *testing.T) {
	deptest.Rules{
		Packages: []string{"./agent/permanent/...", "./wire/addrpolicy/..."},
		BadDeps: map[string]string{
			eitri + "...": "every building block may use a leaf, so a leaf may use nothing else of eitri's",
		},
		StdlibOnly: "every building block may use a leaf, so a leaf brings in no third-party code either",
	}.Check(t)
}

func TestTheAgentNeverImportsTheControlPlane(t *testing.T) {
	deptest.Rules{
		Packages: []string{"./agent/..."},
		BadDeps: map[string]string{
			eitri + "server/...": "the agent and the control plane meet only through gen/ (the protocol) and wire/ (what both sides must agree on): an agent built with server code could run against a control plane it does not match, and the two could not be upgraded apart",
			eitri + "cmd/...":    "cmd/ wires the agent; the agent does not reach back into the command line",
			eitri + "frontend":   "the console is the control plane's",
		},
		Tests: true,
	}.Check(t)
}
