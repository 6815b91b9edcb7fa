// One table's per-row actions (remove, revoke, decommission): which rows are
// busy and the error each last action left, shown on its own row.
import { SvelteMap } from 'svelte/reactivity';
import { errorText } from './errors';

export class RowActions {
	busy = new SvelteMap<string, boolean>();
	errors = new SvelteMap<string, string>();

	/** Runs action for row id; a failure is kept as "<verb> failed: why". */
	async run(id: string, verb: string, action: () => Promise<unknown>): Promise<void> {
		this.errors.delete(id);
		this.busy.set(id, true);
		try {
			await action();
		} catch (err) {
			this.errors.set(id, `${verb} failed: ${errorText(err)}`);
		} finally {
			this.busy.delete(id);
		}
	}
}
