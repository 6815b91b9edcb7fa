// The client side of a Watch* stream: a keyed collection that applies the
// snapshot / changed / removedId events in order.

export type WatchEvent<T> =
	| { case: 'snapshot'; value: T[] }
	| { case: 'changed'; value: T }
	| { case: 'removedId'; value: string }
	| { case: undefined; value?: undefined };

export class WatchStore<T extends { id: string }> {
	#items = new Map<string, T>();
	#onChange: () => void;
	/** True once a snapshot has arrived on the current connection. */
	synced = false;
	/** Bumped on every applied event; cheap change detection for views. */
	version = 0;

	constructor(onChange: () => void = () => {}) {
		this.#onChange = onChange;
	}

	/** Applies one event; returns whether anything changed. */
	apply(ev: WatchEvent<T>): boolean {
		switch (ev.case) {
			case 'snapshot': {
				// The snapshot is complete: anything it does not name is gone, so a
				// reconnect heals removals missed while the stream was down.
				this.#items = new Map(ev.value.map((v) => [v.id, v]));
				this.synced = true;
				break;
			}
			case 'changed':
				this.#items.set(ev.value.id, ev.value);
				break;
			case 'removedId':
				if (!this.#items.delete(ev.value)) return false;
				break;
			default:
				// A newer server may send an event this console does not know.
				return false;
		}
		this.version++;
		this.#onChange();
		return true;
	}

	/** Marks the contents as possibly stale (the stream dropped); they stay
	 *  visible until the next snapshot replaces them. */
	unsync(): void {
		this.synced = false;
	}

	get(id: string): T | undefined {
		return this.#items.get(id);
	}

	get size(): number {
		return this.#items.size;
	}

	values(): T[] {
		return [...this.#items.values()];
	}
}

type WatchResponse = { event: { case: string | undefined; value?: unknown } };
type Changed<R extends WatchResponse> = Extract<R['event'], { case: 'changed' }>['value'];

/** Lifts the generated oneof of a Watch*Response into a WatchEvent, given the
 *  snapshot's list field ("vms", "hosts", "exposures"). */
export function eventOf<R extends WatchResponse>(res: R, listField: string): WatchEvent<Changed<R>> {
	const ev = res.event;
	if (ev.case === 'snapshot') {
		const list = (ev.value as Record<string, unknown>)[listField];
		return { case: 'snapshot', value: (list ?? []) as Changed<R>[] };
	}
	if (ev.case === 'changed' || ev.case === 'removedId') return ev as WatchEvent<Changed<R>>;
	return { case: undefined };
}
