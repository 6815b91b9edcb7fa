import { describe, expect, test } from 'vitest';
import { ConnectError, Code } from '@connectrpc/connect';
import { RowActions } from './rowactions.svelte';

describe('RowActions', () => {
	test('a failed action leaves its error on its own row, in words', async () => {
		const rows = new RowActions();
		await rows.run('x-1', 'remove', async () => {
			throw new ConnectError('exposure x-1 not found', Code.NotFound);
		});
		expect(rows.errors.get('x-1')).toBe('remove failed: exposure x-1 not found');
		expect(rows.errors.get('x-2')).toBeUndefined();
		expect(rows.busy.get('x-1')).toBeUndefined();
	});

	test('a row is busy while its action runs, and a retry clears the old error', async () => {
		const rows = new RowActions();
		rows.errors.set('h-1', 'decommission failed: earlier');
		let release!: () => void;
		const running = rows.run('h-1', 'decommission', () => new Promise<void>((r) => (release = r)));
		expect(rows.busy.get('h-1')).toBe(true);
		expect(rows.errors.get('h-1')).toBeUndefined();
		release();
		await running;
		expect(rows.busy.get('h-1')).toBeUndefined();
		expect(rows.errors.get('h-1')).toBeUndefined();
	});
});
