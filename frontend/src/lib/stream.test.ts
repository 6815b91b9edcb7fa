import { describe, expect, test } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { Code, ConnectError, createClient, createRouterTransport } from '@connectrpc/connect';
import { VMSchema, VMService, type VM } from '@eitri/sdk/vm_pb';
import { backoffDelay, streamFailure, watchLoop, type BackoffOptions, type LinkState } from './stream';
import { WatchStore, eventOf } from './watchstore';

const vm = (id: string, lifecycle = 'ready', statusDetail = '') =>
	create(VMSchema, { id, name: id, lifecycle, statusDetail });
const ids = (s: WatchStore<VM>) =>
	s
		.values()
		.map((v) => `${v.id}:${v.lifecycle}`)
		.sort();

const fixed: BackoffOptions = { baseMs: 500, maxMs: 10_000, random: () => 0.5 };

/** Resolves once the signal aborts, so a handler can hold its stream open. */
const untilAborted = (signal: AbortSignal) =>
	new Promise<void>((resolve) => {
		if (signal.aborted) resolve();
		signal.addEventListener('abort', () => resolve(), { once: true });
	});

describe('backoffDelay', () => {
	test('doubles from 0.5 s and is capped at 10 s', () => {
		const top = { ...fixed, random: () => 1 };
		expect([0, 1, 2, 3, 4, 5, 6, 20].map((a) => backoffDelay(a, top))).toEqual([
			500, 1000, 2000, 4000, 8000, 10_000, 10_000, 10_000
		]);
	});

	test('jitter stays in the upper half of each step', () => {
		expect(backoffDelay(0, { ...fixed, random: () => 0 })).toBe(250);
		expect(backoffDelay(0, fixed)).toBe(375);
		expect(backoffDelay(9, { ...fixed, random: () => 0 })).toBe(5000);
	});
});

describe('streamFailure', () => {
	test('unauthenticated signs out, with the server\'s words', () => {
		expect(streamFailure(new ConnectError('session expired', Code.Unauthenticated))).toEqual({ signedOut: true, message: 'session expired' });
	});
	test('anything else is a reason to reconnect, named by its code when the server said nothing', () => {
		expect(streamFailure(new ConnectError('host gone', Code.Unavailable))).toEqual({ signedOut: false, message: 'host gone' });
		expect(streamFailure(new ConnectError('', Code.Unavailable))).toEqual({ signedOut: false, message: 'Unavailable' });
	});
});

describe('watchLoop over an in-memory router transport', () => {
	test('reconnects with backoff and resumes from the fresh snapshot', async () => {
		let calls = 0;
		// Observed in the gap between connections, to show that the old list
		// stays on screen (unsynced) until the new snapshot replaces it.
		const seenWhileDown: string[][] = [];
		const transport = createRouterTransport(({ service }) => {
			service(VMService, {
				async *watchVMs(_req, ctx) {
					calls++;
					if (calls === 1) {
						yield { event: { case: 'snapshot', value: { vms: [vm('a'), vm('b', 'creating', 'booting')] } } };
						yield { event: { case: 'changed', value: vm('b', 'ready') } };
						throw new ConnectError('control plane restarting', Code.Unavailable);
					}
					if (calls === 2) throw new ConnectError('connection refused', Code.Unavailable);
					if (calls === 3) throw new ConnectError('still down', Code.Unavailable);
					// While we were away: a was deleted, c was created.
					yield { event: { case: 'snapshot', value: { vms: [vm('b', 'stopped'), vm('c', 'creating')] } } };
					yield { event: { case: 'changed', value: vm('c', 'ready') } };
					await untilAborted(ctx.signal);
				}
			});
		});
		const client = createClient(VMService, transport);
		const store = new WatchStore<VM>();
		const ac = new AbortController();
		const states: string[] = [];
		const delays: number[] = [];
		let resolveDone!: () => void;
		const settled = new Promise<void>((r) => (resolveDone = r));

		const loop = watchLoop({
			open: (signal) => client.watchVMs({}, { signal }),
			toEvent: (r) => eventOf(r, 'vms'),
			store,
			signal: ac.signal,
			backoff: fixed,
			onState: (s: LinkState, err) => {
				states.push(err ? `${s}: ${err}` : s);
				if (s === 'live' && calls === 4) setTimeout(resolveDone, 10);
			},
			wait: async (ms) => {
				delays.push(ms);
				seenWhileDown.push([store.synced ? 'synced' : 'unsynced', ...ids(store)]);
			}
		});

		await settled;
		expect(ids(store)).toEqual(['b:stopped', 'c:ready']);
		expect(store.synced).toBe(true);
		// First failure after a healthy snapshot starts at the bottom; each
		// further failure doubles (with random fixed at 0.5: 3/4 of the step).
		expect(delays).toEqual([375, 750, 1500]);
		expect(seenWhileDown[0]).toEqual(['unsynced', 'a:ready', 'b:ready']);
		expect(states).toEqual([
			'connecting',
			'live',
			'reconnecting: control plane restarting',
			'reconnecting: connection refused',
			'reconnecting: still down',
			'live'
		]);

		ac.abort();
		await loop;
		expect(calls).toBe(4);
	});

	test('a healthy snapshot resets the backoff', async () => {
		let calls = 0;
		const transport = createRouterTransport(({ service }) => {
			service(VMService, {
				async *watchVMs() {
					calls++;
					if (calls === 1 || calls === 2) throw new ConnectError('down', Code.Unavailable);
					if (calls === 3) {
						yield { event: { case: 'snapshot', value: { vms: [vm('a')] } } };
						throw new ConnectError('dropped', Code.Unavailable);
					}
					throw new ConnectError('down again', Code.Unavailable);
				}
			});
		});
		const client = createClient(VMService, transport);
		const ac = new AbortController();
		const delays: number[] = [];
		await watchLoop({
			open: (signal) => client.watchVMs({}, { signal }),
			toEvent: (r) => eventOf(r, 'vms'),
			store: new WatchStore<VM>(),
			signal: ac.signal,
			backoff: fixed,
			wait: async (ms) => {
				delays.push(ms);
				if (delays.length === 4) ac.abort();
			}
		});
		expect(delays).toEqual([375, 750, 375, 750]);
	});

	test('an ended session stops the loop instead of retrying', async () => {
		let calls = 0;
		const transport = createRouterTransport(({ service }) => {
			service(VMService, {
				// eslint-disable-next-line require-yield
				async *watchVMs() {
					calls++;
					throw new ConnectError('session expired', Code.Unauthenticated);
				}
			});
		});
		const client = createClient(VMService, transport);
		const states: string[] = [];
		await watchLoop({
			open: (signal) => client.watchVMs({}, { signal }),
			toEvent: (r) => eventOf(r, 'vms'),
			store: new WatchStore<VM>(),
			signal: new AbortController().signal,
			backoff: fixed,
			onState: (s, err) => states.push(`${s}${err ? `: ${err}` : ''}`),
			wait: async () => {
				throw new Error('must not back off');
			}
		});
		expect(calls).toBe(1);
		expect(states).toEqual(['connecting', 'signed-out: session expired']);
	});

	test('a watched object that is not there is an empty list, not a link to retry', async () => {
		const asked: string[] = [];
		const transport = createRouterTransport(({ service }) => {
			service(VMService, {
				async *watchVMs(req) {
					asked.push(req.vmId);
					if (req.vmId === 'a' && asked.length === 1) {
						yield { event: { case: 'snapshot', value: { vms: [vm('a')] } } };
						yield { event: { case: 'removedId', value: 'a' } };
						throw new ConnectError('control plane restarting', Code.Unavailable);
					}
					throw new ConnectError(`vm ${req.vmId} not found`, Code.NotFound);
				}
			});
		});
		const client = createClient(VMService, transport);
		for (const [vmId, calls] of [
			['gone', 1],
			['a', 2]
		] as const) {
			asked.length = 0;
			const store = new WatchStore<VM>();
			store.apply({ case: 'snapshot', value: [vm('stale')] });
			const states: string[] = [];
			await watchLoop({
				open: (signal) => client.watchVMs({ vmId }, { signal }),
				toEvent: (r) => eventOf(r, 'vms'),
				store,
				signal: new AbortController().signal,
				backoff: fixed,
				onState: (s, err) => states.push(`${s}${err ? `: ${err}` : ''}`),
				// The first stream of 'a' saw the VM go and then dropped; the
				// reconnect finds it gone for good.
				wait: async () => {}
			});
			expect(asked).toEqual(Array(calls).fill(vmId));
			expect(store.synced).toBe(true);
			expect(ids(store)).toEqual([]);
			expect(states.at(-1)).toBe('live');
		}
	});

	test('aborting ends an open stream and the loop', async () => {
		let opened!: () => void;
		const isOpen = new Promise<void>((r) => (opened = r));
		let handlerSawAbort = false;
		const transport = createRouterTransport(({ service }) => {
			service(VMService, {
				async *watchVMs(_req, ctx) {
					yield { event: { case: 'snapshot', value: { vms: [vm('a')] } } };
					opened();
					await untilAborted(ctx.signal);
					handlerSawAbort = true;
				}
			});
		});
		const client = createClient(VMService, transport);
		const ac = new AbortController();
		const store = new WatchStore<VM>();
		const loop = watchLoop({
			open: (signal) => client.watchVMs({}, { signal }),
			toEvent: (r) => eventOf(r, 'vms'),
			store,
			signal: ac.signal,
			backoff: fixed
		});
		await isOpen;
		ac.abort();
		await loop;
		expect(ids(store)).toEqual(['a:ready']);
		await new Promise((r) => setTimeout(r, 10));
		expect(handlerSawAbort).toBe(true);
	});
});
