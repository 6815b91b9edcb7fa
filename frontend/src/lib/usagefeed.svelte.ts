// One WatchUsage stream kept open for as long as its effect lives: the
// window first, then each sample, into per-VM and per-host windows the
// charts and sparklines read. It reconnects with the same backoff as the
// Watch* streams, and a reconnect's window replaces what was held.
import { SvelteMap } from 'svelte/reactivity';
import type { HostUsage, VMUsage } from '@eitri/sdk/usage_pb';
import type { Eitri } from './context';
import { backoffDelay, sleep, streamFailure } from './stream';
import { appendSample } from './usage';

export class UsageFeed {
	vms = new SvelteMap<string, VMUsage[]>();
	hosts = new SvelteMap<string, HostUsage[]>();
	/** Set once the first window has arrived. */
	loaded = $state(false);
	error = $state('');

	/** Replaces everything with a window (each series oldest first). */
	window(vms: VMUsage[], hosts: HostUsage[]) {
		this.vms.clear();
		this.hosts.clear();
		for (const s of vms) this.vms.set(s.vmId, appendSample(this.vms.get(s.vmId), s));
		for (const s of hosts) this.hosts.set(s.hostId, appendSample(this.hosts.get(s.hostId), s));
		this.loaded = true;
		this.error = '';
	}

	vm(s: VMUsage) {
		this.vms.set(s.vmId, appendSample(this.vms.get(s.vmId), s));
	}

	host(s: HostUsage) {
		this.hosts.set(s.hostId, appendSample(this.hosts.get(s.hostId), s));
	}
}

/** Streams req into feed; returns the cleanup, for the body of an $effect. */
export function watchUsage(e: Eitri, feed: UsageFeed, req: { vmId?: string; hostId?: string }): () => void {
	const ac = new AbortController();
	void (async () => {
		let attempt = 0;
		while (!ac.signal.aborted) {
			try {
				for await (const r of e.usage.watchUsage(req, { signal: ac.signal })) {
					const ev = r.event;
					if (ev.case === 'window') {
						attempt = 0;
						feed.window(ev.value.vms, ev.value.hosts);
					} else if (ev.case === 'vm' && feed.loaded) {
						feed.vm(ev.value);
					} else if (ev.case === 'host' && feed.loaded) {
						feed.host(ev.value);
					}
				}
			} catch (err) {
				if (ac.signal.aborted) return;
				const f = streamFailure(err);
				if (f.signedOut) {
					e.session.expired = true;
					return;
				}
				feed.error = f.message;
			}
			if (ac.signal.aborted) return;
			await sleep(backoffDelay(attempt), ac.signal);
			attempt++;
		}
	})();
	return () => ac.abort();
}
