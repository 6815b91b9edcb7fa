import { describe, expect, test } from 'vitest';
import { isNarrated, Lifecycle } from './vmstate';

describe('isNarrated', () => {
	test.each([Lifecycle.creating, Lifecycle.starting, Lifecycle.stopping, Lifecycle.restarting, Lifecycle.restoring, Lifecycle.retrying])(
		'work under way (%s) is narrated',
		(lifecycle) => expect(isNarrated({ lifecycle, deleted: false })).toBe(true)
	);
	test.each([Lifecycle.pending, Lifecycle.ready, Lifecycle.stopped, Lifecycle.failed, Lifecycle.deleting, Lifecycle.unknown, Lifecycle.lost, '', 'newer-word'])(
		'a settled or unknown lifecycle (%s) is not',
		(lifecycle) => expect(isNarrated({ lifecycle, deleted: false })).toBe(false)
	);
	test('a deleted VM is not, whatever its lifecycle says', () => {
		expect(isNarrated({ lifecycle: Lifecycle.creating, deleted: true })).toBe(false);
	});
});
