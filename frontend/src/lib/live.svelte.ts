// Svelte-facing state for the console: live lists fed by Watch* streams, the
// board of link states behind the header's live/reconnecting indicator, and
// the signed-in user.
import { SvelteMap } from 'svelte/reactivity';
import { watchLoop, type LinkState } from './stream';
import { WatchStore, type WatchEvent } from './watchstore';
import type { Me } from './session';

/** Every open stream's state, for one indicator in the header. */
export class LinkBoard {
	states = new SvelteMap<symbol, LinkState>();

	/** The worst state across streams; null when none is open. */
	overall: LinkState | null = $derived.by(() => {
		const all = [...this.states.values()];
		if (all.length === 0) return null;
		for (const s of ['signed-out', 'reconnecting', 'connecting'] as const) {
			if (all.includes(s)) return s;
		}
		return 'live';
	});
}

export class Session {
	me: Me | null = $state(null);
	/** Set when a stream or call finds the session gone; the layout sends the
	 *  user to the login page. */
	expired = $state(false);
}

/** A list kept in step with one Watch* stream. Store events arrive as fast as
 *  the server sends them; the rendered array is rebuilt at most once per
 *  animation frame, so a burst of updates costs one render. */
export class LiveList<T extends { id: string }> {
	items: T[] = $state.raw([]);
	state: LinkState = $state('connecting');
	error = $state('');
	/** True once the first snapshot has arrived (ever): before it, "no items"
	 *  means "not known yet", not "none". */
	loaded = $state(false);
	readonly store: WatchStore<T>;
	#compare: ((a: T, b: T) => number) | undefined;
	#pending = false;

	constructor(compare?: (a: T, b: T) => number) {
		this.#compare = compare;
		this.store = new WatchStore<T>(() => this.#schedule());
	}

	#schedule() {
		if (this.#pending) return;
		this.#pending = true;
		const flush = () => {
			this.#pending = false;
			const list = this.store.values();
			if (this.#compare) list.sort(this.#compare);
			this.items = list;
			if (this.store.synced) this.loaded = true;
		};
		if (typeof requestAnimationFrame === 'function' && document.visibilityState === 'visible') {
			requestAnimationFrame(flush);
		} else {
			// A hidden tab gets no frames; a task keeps the list current for
			// when it is shown again.
			setTimeout(flush, 0);
		}
	}
}

export type StartWatch<Res, T extends { id: string }> = {
	list: LiveList<T>;
	open: (signal: AbortSignal) => AsyncIterable<Res>;
	toEvent: (res: Res) => WatchEvent<T>;
	board: LinkBoard;
	session: Session;
};

/** Starts a stream into a list and returns its cleanup: call it as the body
 *  of an $effect so the stream lives exactly as long as the effect. */
export function startWatch<Res, T extends { id: string }>(o: StartWatch<Res, T>): () => void {
	const ac = new AbortController();
	const key = Symbol('watch');
	const set = (s: LinkState, err: string) => {
		o.list.state = s;
		o.list.error = err;
		o.board.states.set(key, s);
		if (s === 'signed-out') o.session.expired = true;
	};
	void watchLoop({ open: o.open, toEvent: o.toEvent, store: o.list.store, signal: ac.signal, onState: set });
	return () => {
		ac.abort();
		o.board.states.delete(key);
	};
}
