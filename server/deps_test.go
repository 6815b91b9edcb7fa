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

func TestTheCallRelayNeverImportsTheFleet(t *testing.T) {
	deptest.Rules{
		Packages: []string{"./server/callrelay/..."},
		BadDeps: map[string]string{
			eitri + "server/fleet": "the fleet authorizes a console or tunnel and hands the relay what it needs to know of the hosts through the relay's own small interfaces (callrelay.Hosts, callrelay.CallStore); a relay that reached into the fleet would tie the two into one cycle of state and locks, and could not be tested or grown to cross replicas on its own",
			eitri + "server/api":   "the API is the relay's caller: it turns the relay's errors into Connect codes and carries its streams",
		},
		Tests: true,
	}.Check(t)
}
