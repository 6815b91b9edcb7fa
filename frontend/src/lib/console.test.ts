import { describe, expect, test } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { Code, ConnectError, createClient, createRouterTransport } from '@connectrpc/connect';
import { StreamConsoleResponseSchema, VMService } from '@eitri/sdk/vm_pb';
import { InputQueue, batches, consoleLoop, take, type ConsoleRequest } from './console';
import type { BackoffOptions, LinkState } from './stream';

const enc = new TextEncoder();
const dec = new TextDecoder();
const msg = (text: string, boot: string, offset: number, newBoot = false) =>
	create(StreamConsoleResponseSchema, { data: enc.encode(text), boot, offset: BigInt(offset), newBoot });
const fixed: BackoffOptions = { baseMs: 500, maxMs: 10_000, random: () => 0.5 };

describe('take', () => {
	test('moves the resume point past what it writes', () => {
		const t = take({ boot: '', offset: 0n }, msg('hello', 'b1', 100));
		expect(dec.decode(t.data)).toBe('hello');
		expect(t.next).toEqual({ boot: 'b1', offset: 105n });
		expect(t.newBoot).toBe(false);
	});

	test('drops bytes before the resume point of the same boot', () => {
		const t = take({ boot: 'b1', offset: 103n }, msg('hello', 'b1', 100));
		expect(dec.decode(t.data)).toBe('lo');
		expect(t.next).toEqual({ boot: 'b1', offset: 105n });
	});

	test('a new boot is marked and starts its own count', () => {
		const t = take({ boot: 'b1', offset: 500n }, msg('boot two', 'b2', 0, true));
		expect(t.newBoot).toBe(true);
		expect(dec.decode(t.data)).toBe('boot two');
		expect(t.next).toEqual({ boot: 'b2', offset: 8n });
	});

	test('an empty opening message with no log keeps the point', () => {
		const t = take({ boot: '', offset: 0n }, msg('', '', 0));
		expect(t.data.length).toBe(0);
		expect(t.next).toEqual({ boot: '', offset: 0n });
	});
});

describe('consoleLoop over an in-memory router transport', () => {
	test('resumes from the last byte written after a drop, with backoff', async () => {
		const asked: ConsoleRequest[] = [];
		let calls = 0;
		const transport = createRouterTransport(({ service }) => {
			service(VMService, {
				async *streamConsole(req) {
					asked.push({ vmId: req.vmId, boot: req.boot, offset: req.offset });
					calls++;
					if (calls === 1) {
						yield msg('one ', 'b1', 0);
						yield msg('two ', 'b1', 4);
						throw new ConnectError('host went away', Code.Unavailable);
					}
					yield msg('three', 'b1', 8);
					ac.abort();
				}
			});
		});
		const client = createClient(VMService, transport);
		const ac = new AbortController();
		let out = '';
		const states: string[] = [];
		const waits: number[] = [];
		await consoleLoop({
			vmId: 'vm-1',
			open: (req, signal) => client.streamConsole(req, { signal }),
			write: (d) => (out += dec.decode(d)),
			signal: ac.signal,
			onState: (s: LinkState, e) => states.push(e ? `${s}:${e}` : s),
			backoff: fixed,
			wait: async (ms) => {
				waits.push(ms);
			}
		});
		expect(out).toBe('one two three');
		expect(asked).toEqual([
			{ vmId: 'vm-1', boot: '', offset: 0n },
			{ vmId: 'vm-1', boot: 'b1', offset: 8n }
		]);
		expect(states).toEqual(['connecting', 'live', 'reconnecting:host went away', 'live']);
		expect(waits).toEqual([375]);
	});

	test('stops when the session is gone', async () => {
		const transport = createRouterTransport(({ service }) => {
			service(VMService, {
				// eslint-disable-next-line require-yield
				async *streamConsole() {
					throw new ConnectError('signed out', Code.Unauthenticated);
				}
			});
		});
		const client = createClient(VMService, transport);
		const states: string[] = [];
		await consoleLoop({
			vmId: 'vm-1',
			open: (req, signal) => client.streamConsole(req, { signal }),
			write: () => {},
			signal: new AbortController().signal,
			onState: (s) => states.push(s),
			wait: async () => {}
		});
		expect(states).toEqual(['connecting', 'signed-out']);
	});
});

describe('InputQueue', () => {
	test('batches at the API bound', () => {
		expect(batches(new Uint8Array(9000)).map((b) => b.length)).toEqual([4096, 4096, 808]);
	});

	test('sends in order, coalescing what is typed during a call, and waits out ResourceExhausted', async () => {
		const sent: string[] = [];
		let fail = 1;
		let release: () => void = () => {};
		const ac = new AbortController();
		const q = new InputQueue(
			async (d) => {
				if (sent.length === 0 && fail-- > 0) throw new ConnectError('slow down', Code.ResourceExhausted);
				if (sent.length === 0) await new Promise<void>((r) => (release = r));
				sent.push(dec.decode(d));
			},
			ac.signal,
			() => {},
			async () => {}
		);
		q.push(enc.encode('a'));
		await Promise.resolve();
		q.push(enc.encode('b'));
		q.push(enc.encode('c'));
		await new Promise((r) => setTimeout(r, 0));
		release();
		await new Promise((r) => setTimeout(r, 0));
		await q.drain();
		expect(sent).toEqual(['a', 'bc']);
	});

	test('another failure drops the queue and says why', async () => {
		const errors: string[] = [];
		const q = new InputQueue(
			async () => {
				throw new ConnectError('the vm is not running', Code.FailedPrecondition);
			},
			new AbortController().signal,
			(m) => errors.push(m)
		);
		q.push(enc.encode('x'));
		await q.drain();
		await new Promise((r) => setTimeout(r, 0));
		expect(errors).toEqual(['the vm is not running']);
	});
});
