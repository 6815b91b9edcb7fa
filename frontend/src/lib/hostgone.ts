// When a host may be decommissioned by force: the control plane allows it
// only for a host that has been gone for a while (fleet.ForceDecommissionAfter),
// so a reboot or a short outage is never taken for a dead machine. The console
// offers the option from the same moment; the server still has the last word.
import type { Host } from '@eitri/sdk/host_pb';
import { tsDate } from './display';

export const forceAfterMs = 10 * 60 * 1000;

/** Milliseconds until force is allowed for h at now: 0 when it is, null when
 *  never (a connected host). A host never seen counts from its enrolment. */
export function forceWaitMs(h: Pick<Host, 'connected' | 'lastSeenAt' | 'createdAt'>, now: Date): number | null {
	if (h.connected) return null;
	const since = tsDate(h.lastSeenAt) ?? tsDate(h.createdAt);
	if (!since) return 0;
	return Math.max(0, forceAfterMs - (now.getTime() - since.getTime()));
}
