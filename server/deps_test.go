package server_test

import (
	"testing"

	"github.com/a73x/eitri/internal/deptest"
)

const eitri = deptest.Module + "/"

func TestTheControlPlaneNeverImportsTheAgent(t *testing.T) {
	deptest.Rules{
		Packages: []string{"./server/..."},
		BadDeps: map[string]string{
			eitri + "agent/...": "the control plane and the agent meet only through gen/ (the protocol) and wire/ (what both sides must agree on): a control plane built with agent code would hide a protocol gap from every agent it does not match, and the two could not be upgraded apart",
			eitri + "cmd/...":   "cmd/ wires the control plane; the control plane does not reach back into the command line",
			eitri + "frontend":  "the console is built by npm and handed to server.New by cmd/eitri, so the control plane builds and tests without it",
		},
		Tests: true,
	}.Check(t)
}
