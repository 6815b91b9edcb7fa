// The console's streams, each bound to a live list. A page calls one
// as the body of an $effect, so the stream lives exactly as long as the
// effect (the returned cleanup aborts it).
import type { VM } from '@eitri/sdk/vm_pb';
import type { Host } from '@eitri/sdk/host_pb';
import type { Exposure } from '@eitri/sdk/exposure_pb';
import type { Rollout } from '@eitri/sdk/release_pb';
import type { Eitri } from './context';
import { startWatch, type LiveList } from './live.svelte';
import { eventOf } from './watchstore';

/** Every VM the user can see, or with vmId (a VM page) that VM alone: the
 *  page then hears nothing of the rest of the fleet. */
export function watchVMs(e: Eitri, list: LiveList<VM>, vmId = ''): () => void {
	return startWatch({
		list,
		open: (signal) => e.vms.watchVMs({ vmId }, { signal }),
		toEvent: (r) => eventOf(r, 'vms'),
		board: e.board,
		session: e.session
	});
}

export function watchHosts(e: Eitri, list: LiveList<Host>): () => void {
	return startWatch({
		list,
		open: (signal) => e.hosts.watchHosts({}, { signal }),
		toEvent: (r) => eventOf(r, 'hosts'),
		board: e.board,
		session: e.session
	});
}

export function watchExposures(e: Eitri, list: LiveList<Exposure>, vmId: string): () => void {
	return startWatch({
		list,
		open: (signal) => e.exposures.watchExposures({ vmId }, { signal }),
		toEvent: (r) => eventOf(r, 'exposures'),
		board: e.board,
		session: e.session
	});
}

/** Every agent rollout, the newest first by the page's own order. */
export function watchRollouts(e: Eitri, list: LiveList<Rollout>): () => void {
	return startWatch({
		list,
		open: (signal) => e.releases.watchRollouts({}, { signal }),
		toEvent: (r) => eventOf(r, 'rollouts'),
		board: e.board,
		session: e.session
	});
}
