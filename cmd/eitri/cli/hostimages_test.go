package cli

import (
	"bytes"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

func TestHostImagesSaysWhatPinsEachImageAndWhatUsesIt(t *testing.T) {
	var out bytes.Buffer
	hostImageTable(&out, []*eitriv1.HostImage{
		{Sha256: strings.Repeat("a", 64), SizeBytes: 3 << 20, Pinned: true, PulledFor: []string{"tools"},
			Catalogue: []*eitriv1.CatalogueVersion{{Name: "tools", Version: 2, Current: true}, {Name: "tools-old", Version: 1}}},
		{Sha256: strings.Repeat("b", 64), SizeBytes: 5 << 30, Vms: []*eitriv1.HostImageVM{{Id: "vm-1", Name: "web-1"}, {Id: "vm-2"}}, MoreVms: 3},
		{Sha256: strings.Repeat("c", 64), Pinned: true},
	})
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	require.Len(t, lines, 4)
	assert.Contains(t, lines[0], "PINNED")
	assert.Contains(t, lines[1], "aaaaaaaaaaaa…\t")
	assert.Contains(t, lines[1], "3.0 MiB")
	assert.Contains(t, lines[1], "pull of tools")
	assert.Contains(t, lines[1], "tools v2 (current), tools-old v1")
	assert.Contains(t, lines[2], "5.0 GiB")
	assert.Contains(t, lines[2], "\tno\t")
	assert.Contains(t, lines[2], "web-1, vm-2, +3 more", "a VM the control plane has no name for shows its id")
	assert.Contains(t, lines[3], "yes (in use)", "pinned by no pull: a create holds it")
}
