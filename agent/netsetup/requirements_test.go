package netsetup

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRequirementsSayWhatTheNetworkLacksAndHowToFixIt(t *testing.T) {
	tun := filepath.Join(t.TempDir(), "tun") // a regular file, not a device
	require.NoError(t, os.WriteFile(tun, nil, 0o600))
	noCaps := func() (uint64, error) { return 0, nil }
	netAdmin := func() (uint64, error) { return 1 << capNetAdmin, nil }

	missing := requirements(tun, 1000, noCaps)
	require.Len(t, missing, 2)
	assert.Contains(t, missing[0], "CAP_NET_ADMIN")
	assert.Contains(t, missing[1], "modprobe tun")

	assert.Empty(t, requirements("/dev/null", 1000, netAdmin), "CAP_NET_ADMIN is enough without root")
	assert.Empty(t, requirements("/dev/null", 0, noCaps), "root needs no capability bits")
}
