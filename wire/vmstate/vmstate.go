// Package vmstate holds the words the wire uses for a VM's state, defined
// once for the control plane, the agent, the CLI and MCP (the console's
// copy is frontend/src/lib/vmstate.ts): power (VM.power_state,
// ActualVM.power), the phase a host reports (ActualVM.phase), and the one
// lifecycle word a person reads (VM.lifecycle). The fields stay strings on
// the wire, so a newer side's word passes through an older one unharmed.
package vmstate

// Power: what a VM's owner wants (VM.power_state) and what its host says
// the guest is doing (ActualVM.power).
const (
	PowerRunning = "running"
	PowerStopped = "stopped"
)

// Phases a host reports for a VM (ActualVM.phase).
const (
	PhaseCreating = "creating"
	PhaseReady    = "ready"
	PhaseStopped  = "stopped"
	PhaseFailed   = "failed"
	PhaseDeleting = "deleting"
	// A created VM being booted (PhaseRestarting: after its guest ended
	// unasked, or a start failed) or shut down.
	PhaseStarting   = "starting"
	PhaseRestarting = "restarting"
	PhaseStopping   = "stopping"
)

// Lifecycle words (VM.lifecycle): the control plane derives them from what
// was asked and what the host reported.
const (
	// Not yet listed by its host; Unknown: listed before, but its host is
	// not reporting now.
	LifecyclePending = "pending"
	LifecycleUnknown = "unknown"

	LifecycleCreating = PhaseCreating
	LifecycleReady    = PhaseReady
	LifecycleStopped  = PhaseStopped
	LifecycleFailed   = PhaseFailed
	LifecycleDeleting = PhaseDeleting
	// Its host was decommissioned by force: nothing runs it anywhere. No
	// host will report on it again, so the control plane stores this word
	// as its status too.
	LifecycleLost = "lost"

	// A request on its way, shown from the moment it is made until the
	// host's report confirms it (or, for Restarting, the host's own work).
	LifecycleStarting   = PhaseStarting
	LifecycleStopping   = PhaseStopping
	LifecycleRestarting = PhaseRestarting
	LifecycleRestoring  = "restoring"
	LifecycleRetrying   = "retrying"
)

// Narrated reports whether a VM in this lifecycle is doing work its host
// narrates (VM.status_detail, VM.progress), which is then worth showing. A
// settled VM shows none, even when a stale sentence arrives with it.
func Narrated(lifecycle string) bool {
	switch lifecycle {
	case LifecycleCreating, LifecycleStarting, LifecycleStopping, LifecycleRestarting, LifecycleRestoring, LifecycleRetrying:
		return true
	}
	return false
}
