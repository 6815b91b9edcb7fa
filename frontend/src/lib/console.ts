// A VM's serial console as a terminal sees it: the output stream kept open
// with the same backoff as every other stream, resumed after a drop from
// the last byte shown (so nothing is written twice), and keystrokes sent in
// order, in batches no larger than the API takes.
import { Code, ConnectError } from '@connectrpc/connect';
import type { MessageInitShape } from '@bufbuild/protobuf';
import type { StreamConsoleRequestSchema, StreamConsoleResponse } from '@eitri/sdk/vm_pb';
import { backoffDelay, defaultBackoff, sleep, streamFailure, type BackoffOptions, type LinkState } from './stream';

export type ConsoleRequest = MessageInitShape<typeof StreamConsoleRequestSchema>;

/** Where the next stream resumes: the boot and the offset after the last
 *  byte written. Empty boot: not resuming (the server sends the tail). */
export type ResumePoint = { boot: string; offset: bigint };

/** The request that resumes from p. */
export function resumeRequest(vmId: string, p: ResumePoint): ConsoleRequest {
	return p.boot ? { vmId, boot: p.boot, offset: p.offset } : { vmId };
}

/** What a message adds to the screen, given where the screen is, and where
 *  it is after. Bytes before the resume point (a server that sent a little
 *  more than asked) are dropped; a new boot is marked. */
export function take(p: ResumePoint, m: Pick<StreamConsoleResponse, 'data' | 'boot' | 'offset' | 'newBoot'>): {
	data: Uint8Array;
	newBoot: boolean;
	next: ResumePoint;
} {
	let data = m.data;
	const sameBoot = p.boot !== '' && m.boot === p.boot && !m.newBoot;
	if (sameBoot && m.offset < p.offset) {
		const skip = Number(p.offset - m.offset);
		data = data.subarray(Math.min(skip, data.length));
	}
	const end = m.offset + BigInt(m.data.length);
	const next = m.boot ? { boot: m.boot, offset: sameBoot && end < p.offset ? p.offset : end } : p;
	return { data, newBoot: m.newBoot && p.boot !== '', next };
}

export type ConsoleLoopOptions = {
	vmId: string;
	open: (req: ConsoleRequest, signal: AbortSignal) => AsyncIterable<StreamConsoleResponse>;
	/** Writes output; newBoot when it starts a boot after the one shown. */
	write: (data: Uint8Array, newBoot: boolean) => void;
	signal: AbortSignal;
	onState?: (state: LinkState, error: string) => void;
	backoff?: BackoffOptions;
	wait?: (ms: number, signal: AbortSignal) => Promise<void>;
};

/** Runs until the signal aborts or the session is gone. */
export async function consoleLoop(o: ConsoleLoopOptions): Promise<void> {
	const backoff = o.backoff ?? defaultBackoff;
	const wait = o.wait ?? sleep;
	const report = o.onState ?? (() => {});
	let at: ResumePoint = { boot: '', offset: 0n };
	let attempt = 0;
	report('connecting', '');
	while (!o.signal.aborted) {
		let error = 'the server closed the stream';
		try {
			let first = true;
			for await (const m of o.open(resumeRequest(o.vmId, at), o.signal)) {
				if (first) {
					first = false;
					attempt = 0;
					report('live', '');
				}
				const t = take(at, m);
				at = t.next;
				if (t.data.length > 0 || t.newBoot) o.write(t.data, t.newBoot);
			}
		} catch (e) {
			if (o.signal.aborted) return;
			const f = streamFailure(e);
			if (f.signedOut) {
				report('signed-out', f.message);
				return;
			}
			error = f.message;
		}
		if (o.signal.aborted) return;
		report('reconnecting', error);
		await wait(backoffDelay(attempt, backoff), o.signal);
		attempt++;
	}
}

/** The API's bound on one SendConsoleInput. */
export const maxInput = 4096;

/** Splits bytes into batches the API takes. */
export function batches(data: Uint8Array, max = maxInput): Uint8Array[] {
	const out: Uint8Array[] = [];
	for (let i = 0; i < data.length; i += max) out.push(data.subarray(i, i + max));
	return out;
}

/** Sends keystrokes in order, one call at a time; what is typed while a
 *  call is out goes in the next one. Typing too fast (ResourceExhausted)
 *  waits and tries again; any other failure drops what was queued and is
 *  reported. */
export class InputQueue {
	private queue: Uint8Array[] = [];
	private busy = false;
	constructor(
		private send: (data: Uint8Array, signal: AbortSignal) => Promise<unknown>,
		private signal: AbortSignal,
		private onError: (message: string) => void,
		private wait: (ms: number, signal: AbortSignal) => Promise<void> = sleep
	) {}

	push(data: Uint8Array) {
		if (data.length === 0 || this.signal.aborted) return;
		this.queue.push(data);
		if (!this.busy) void this.drain();
	}

	/** Resolves once everything queued has been sent (or dropped). */
	async drain(): Promise<void> {
		if (this.busy) return;
		this.busy = true;
		try {
			while (this.queue.length > 0 && !this.signal.aborted) {
				const all = concat(this.queue);
				this.queue = [];
				for (const b of batches(all)) {
					let ok = false;
					for (let tries = 0; !ok && !this.signal.aborted; tries++) {
						try {
							await this.send(b, this.signal);
							ok = true;
						} catch (e) {
							if (this.signal.aborted) return;
							const ce = ConnectError.from(e);
							if (ce.code === Code.ResourceExhausted && tries < 10) {
								await this.wait(500, this.signal);
								continue;
							}
							this.onError(ce.rawMessage || Code[ce.code]);
							this.queue = [];
							return;
						}
					}
				}
			}
		} finally {
			this.busy = false;
		}
	}
}

function concat(parts: Uint8Array[]): Uint8Array {
	if (parts.length === 1) return parts[0];
	const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
	let at = 0;
	for (const p of parts) {
		out.set(p, at);
		at += p.length;
	}
	return out;
}
