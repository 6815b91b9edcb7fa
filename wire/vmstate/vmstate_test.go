package vmstate_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/wire/vmstate"
)

func TestOnlyWorkUnderWayIsNarrated(t *testing.T) {
	for lc, want := range map[string]bool{
		vmstate.LifecycleCreating: true, vmstate.LifecycleStarting: true, vmstate.LifecycleStopping: true,
		vmstate.LifecycleRestarting: true, vmstate.LifecycleRestoring: true, vmstate.LifecycleRetrying: true,
		vmstate.LifecyclePending: false, vmstate.LifecycleReady: false, vmstate.LifecycleStopped: false,
		vmstate.LifecycleFailed: false, vmstate.LifecycleDeleting: false, vmstate.LifecycleUnknown: false,
		vmstate.LifecycleLost: false, "": false, "a word from a newer server": false,
	} {
		assert.Equal(t, want, vmstate.Narrated(lc), "lifecycle %q", lc)
	}
}
