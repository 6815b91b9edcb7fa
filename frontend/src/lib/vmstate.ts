// The words the wire uses for a VM's state, defined once for the console
// (the Go side's copy is wire/vmstate). The fields stay strings on the
// wire, so a word from a newer control plane passes through unharmed.
import type { VM } from '@eitri/sdk/vm_pb';

/** What a VM's owner wants (VM.powerState) and its host says (VM.actualPower). */
export const Power = { running: 'running', stopped: 'stopped' } as const;

/** The one lifecycle word a person reads (VM.lifecycle). */
export const Lifecycle = {
	pending: 'pending',
	creating: 'creating',
	ready: 'ready',
	stopped: 'stopped',
	failed: 'failed',
	deleting: 'deleting',
	unknown: 'unknown',
	lost: 'lost',
	starting: 'starting',
	stopping: 'stopping',
	restarting: 'restarting',
	restoring: 'restoring',
	retrying: 'retrying'
} as const;
export type Lifecycle = (typeof Lifecycle)[keyof typeof Lifecycle];

/** Lifecycles that are work under way, which the host narrates. */
const narrated: ReadonlySet<string> = new Set<Lifecycle>([
	Lifecycle.creating,
	Lifecycle.starting,
	Lifecycle.stopping,
	Lifecycle.restarting,
	Lifecycle.restoring,
	Lifecycle.retrying
]);

/** Whether the host's account of its work (its sentence, its progress) is
 *  shown for this VM: only while work is in flight. The one place the
 *  console decides it. */
export function isNarrated(vm: Pick<VM, 'lifecycle' | 'deleted'>): boolean {
	return !vm.deleted && narrated.has(vm.lifecycle);
}
