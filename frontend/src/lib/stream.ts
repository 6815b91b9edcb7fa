// Keeps one Watch* stream open for as long as its signal lives: reconnects
// with capped, jittered exponential backoff and lets the first message of each
// new connection (always a full snapshot) replace whatever was shown before.
import { Code, ConnectError } from '@connectrpc/connect';
import type { WatchEvent, WatchStore } from './watchstore';

export type LinkState = 'connecting' | 'live' | 'reconnecting' | 'signed-out';

export type BackoffOptions = {
	/** First delay, ms. */
	baseMs: number;
	/** Ceiling, ms. */
	maxMs: number;
	/** 0..1 source of jitter; Math.random in the browser. */
	random: () => number;
};

export const defaultBackoff: BackoffOptions = { baseMs: 500, maxMs: 10_000, random: Math.random };

/** What a stream's failure means: signed out (stop; only signing in again
 *  helps), or a reason to show while reconnecting. Every stream loop in the
 *  console reads its errors here, so all of them stop on the same cause. */
export function streamFailure(e: unknown): { signedOut: boolean; message: string } {
	const ce = ConnectError.from(e);
	if (ce.code === Code.Unauthenticated) return { signedOut: true, message: ce.rawMessage };
	return { signedOut: false, message: ce.rawMessage || Code[ce.code] };
}

/** The wait before reconnect attempt `attempt` (0-based): base·2^attempt capped
 *  at max, then "equal jitter" — somewhere in its upper half — so a fleet of
 *  consoles that lost the server together does not come back in lockstep. */
export function backoffDelay(attempt: number, o: BackoffOptions = defaultBackoff): number {
	const ceiling = Math.min(o.maxMs, o.baseMs * 2 ** Math.min(attempt, 30));
	return Math.round(ceiling / 2 + (o.random() * ceiling) / 2);
}

/** Resolves after ms, or at once when the signal aborts. */
export function sleep(ms: number, signal: AbortSignal): Promise<void> {
	return new Promise((resolve) => {
		if (signal.aborted) return resolve();
		const done = () => {
			clearTimeout(t);
			signal.removeEventListener('abort', done);
			resolve();
		};
		const t = setTimeout(done, ms);
		signal.addEventListener('abort', done, { once: true });
	});
}

export type WatchLoopOptions<Res, T extends { id: string }> = {
	/** Opens one connection; must end when the signal aborts. */
	open: (signal: AbortSignal) => AsyncIterable<Res>;
	toEvent: (res: Res) => WatchEvent<T>;
	store: WatchStore<T>;
	signal: AbortSignal;
	onState?: (state: LinkState, error: string) => void;
	backoff?: BackoffOptions;
	/** Injected in tests to observe delays without waiting. */
	wait?: (ms: number, signal: AbortSignal) => Promise<void>;
};

/** Runs until the signal aborts, the server says the session is gone, or
 *  the one object watched is not (or no longer) there. */
export async function watchLoop<Res, T extends { id: string }>(o: WatchLoopOptions<Res, T>): Promise<void> {
	const backoff = o.backoff ?? defaultBackoff;
	const wait = o.wait ?? sleep;
	const report = o.onState ?? (() => {});
	let attempt = 0;
	let error = '';
	report('connecting', '');
	while (!o.signal.aborted) {
		try {
			for await (const res of o.open(o.signal)) {
				const ev = o.toEvent(res);
				if (ev.case === 'snapshot') {
					// A fresh full list: the link is healthy again and the next
					// failure starts the backoff from the bottom.
					attempt = 0;
					error = '';
					o.store.apply(ev);
					report('live', '');
				} else if (o.store.synced) {
					o.store.apply(ev);
				}
			}
			error = 'the server closed the stream';
		} catch (e) {
			if (o.signal.aborted) return;
			const f = streamFailure(e);
			if (f.signedOut) {
				report('signed-out', f.message);
				return;
			}
			if (ConnectError.from(e).code === Code.NotFound) {
				// A watch of one object (a VM page's) that is gone, or never
				// was the caller's: that is an answer — nothing to show — not a
				// broken link, and asking again would not change it.
				o.store.apply({ case: 'snapshot', value: [] });
				report('live', '');
				return;
			}
			error = f.message;
		}
		if (o.signal.aborted) return;
		o.store.unsync();
		report('reconnecting', error);
		await wait(backoffDelay(attempt, backoff), o.signal);
		attempt++;
	}
}

