import { expect, test, vi } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { Code, ConnectError, createClient, createRouterTransport } from '@connectrpc/connect';
import { VMSchema, VMService, type VM } from '@eitri/sdk/vm_pb';
import { LinkBoard, LiveList, Session, startWatch } from './live.svelte';
import { eventOf } from './watchstore';

const vm = (id: string, lifecycle = 'ready') => create(VMSchema, { id, name: id, lifecycle });

test('startWatch feeds a LiveList, reports on the board, and stops on cleanup', async () => {
	let aborted = false;
	const transport = createRouterTransport(({ service }) => {
		service(VMService, {
			async *watchVMs(_req, ctx) {
				yield { event: { case: 'snapshot', value: { vms: [vm('b'), vm('a', 'creating')] } } };
				yield { event: { case: 'changed', value: vm('a', 'ready') } };
				await new Promise<void>((r) => ctx.signal.addEventListener('abort', () => r()));
				aborted = true;
			}
		});
	});
	const client = createClient(VMService, transport);
	const list = new LiveList<VM>((x, y) => x.name.localeCompare(y.name));
	const board = new LinkBoard();
	const session = new Session();
	expect(board.overall).toBeNull();

	const stop = startWatch({
		list,
		open: (signal) => client.watchVMs({}, { signal }),
		toEvent: (r) => eventOf(r, 'vms'),
		board,
		session
	});
	await vi.waitFor(() => expect(list.items.map((v) => `${v.id}:${v.lifecycle}`)).toEqual(['a:ready', 'b:ready']));
	expect(list.loaded).toBe(true);
	expect(list.state).toBe('live');
	expect(board.overall).toBe('live');

	stop();
	expect(board.overall).toBeNull();
	await vi.waitFor(() => expect(aborted).toBe(true));
});

test('a stream that finds the session gone marks it expired', async () => {
	const transport = createRouterTransport(({ service }) => {
		service(VMService, {
			// eslint-disable-next-line require-yield
			async *watchVMs() {
				throw new ConnectError('session revoked', Code.Unauthenticated);
			}
		});
	});
	const client = createClient(VMService, transport);
	const list = new LiveList<VM>();
	const board = new LinkBoard();
	const session = new Session();
	const stop = startWatch({
		list,
		open: (signal) => client.watchVMs({}, { signal }),
		toEvent: (r) => eventOf(r, 'vms'),
		board,
		session
	});
	await vi.waitFor(() => expect(session.expired).toBe(true));
	expect(list.error).toBe('session revoked');
	expect(board.overall).toBe('signed-out');
	stop();
});
