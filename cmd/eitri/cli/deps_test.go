package cli_test

import (
	"testing"

	"github.com/a73x/eitri/internal/deptest"
)

func TestClientCommandsImportOnlyTheAPIAndTheWire(t *testing.T) {
	deptest.Rules{
		Packages: []string{"./cmd/eitri/cli/..."},
		Only:     []string{deptest.Module + "/gen/...", deptest.Module + "/wire/..."},
		OnlyWhy: "the client commands see the fleet as any API client does, through the API (gen/) and what every side shares (wire/): " +
			"a command built on server or agent code would work only against the build it came with, and would hide what the API cannot do",
		Tests: true,
	}.Check(t)
}
