// What the console says about agents' upgrades and guests' SSH trust. The
// words come from the control plane (a host's stuck condition, a VM's fix);
// these only choose which to show.
import type { Host } from '@eitri/sdk/host_pb';
import type { Rollout } from '@eitri/sdk/release_pb';
import type { VM } from '@eitri/sdk/vm_pb';

/** A host is "connected" or "offline": an offline host is never stuck,
 *  whatever it was offered. */
export function hostLink(h: Pick<Host, 'connected'>): string {
	return h.connected ? 'connected' : 'offline';
}

/** The host's upgrade in one line, or '' when there is nothing to say: no
 *  upgrade, one that is done, or one the stuck condition already says. */
export function upgradeNote(h: Pick<Host, 'upgrade'>): string {
	const u = h.upgrade;
	if (!u || u.stuck || u.step === 'done') return '';
	if (u.step === 'failed') return `upgrade to ${u.target} failed: ${u.error}`;
	return `upgrading to ${u.target}: ${u.detail || u.step}`;
}

/** The rollout still worth showing: the newest, unless it ended. */
export function activeRollout(rollouts: Rollout[]): Rollout | undefined {
	const newest = [...rollouts].sort((a, b) => Number((b.createdAt?.seconds ?? 0n) - (a.createdAt?.seconds ?? 0n)))[0];
	if (!newest || newest.state === 'done' || newest.state === 'aborted') return undefined;
	return newest;
}

/** A rollout's headline: where it is, and why when it stopped. */
export function rolloutLine(r: Rollout): string {
	const done = r.hosts.filter((h) => h.state === 'done').length;
	const why = r.reason ? ` — ${r.reason}` : '';
	return `Upgrading to ${r.version}: ${r.state}, ${done}/${r.hosts.length} hosts done${why}`;
}

/** The VM's SSH trust, or '' when its guest trusts the current user CA (or
 *  nothing is known of what it trusts). */
export function trustWarning(v: Pick<VM, 'trustStale' | 'trustFix'>): string {
	return v.trustStale ? `stale SSH trust: ${v.trustFix}` : '';
}
