import { describe, expect, test } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { WatchVMsResponseSchema, VMSchema, type VM } from '@eitri/sdk/vm_pb';
import { WatchStore, eventOf } from './watchstore';

const vm = (id: string, lifecycle = 'ready') => create(VMSchema, { id, name: id, lifecycle });
const ids = (s: WatchStore<VM>) => s.values().map((v) => `${v.id}:${v.lifecycle}`);

describe('WatchStore', () => {
	test('applies snapshot, changed and removedId in order', () => {
		let notified = 0;
		const s = new WatchStore<VM>(() => notified++);
		expect(s.synced).toBe(false);
		s.apply({ case: 'snapshot', value: [vm('a'), vm('b', 'creating')] });
		expect(s.synced).toBe(true);
		s.apply({ case: 'changed', value: vm('b', 'ready') });
		s.apply({ case: 'changed', value: vm('c', 'pending') });
		s.apply({ case: 'removedId', value: 'a' });
		expect(ids(s)).toEqual(['b:ready', 'c:pending']);
		expect(notified).toBe(4);
		expect(s.version).toBe(4);
	});

	test('a snapshot replaces everything, dropping what it does not name', () => {
		const s = new WatchStore<VM>();
		s.apply({ case: 'snapshot', value: [vm('a'), vm('b')] });
		s.apply({ case: 'snapshot', value: [vm('b', 'stopped'), vm('c')] });
		expect(ids(s)).toEqual(['b:stopped', 'c:ready']);
	});

	test('removing an unknown id or an unknown event changes nothing', () => {
		let notified = 0;
		const s = new WatchStore<VM>(() => notified++);
		s.apply({ case: 'snapshot', value: [vm('a')] });
		expect(s.apply({ case: 'removedId', value: 'zz' })).toBe(false);
		expect(s.apply({ case: undefined })).toBe(false);
		expect(notified).toBe(1);
	});

	test('unsync keeps the items visible until the next snapshot', () => {
		const s = new WatchStore<VM>();
		s.apply({ case: 'snapshot', value: [vm('a')] });
		s.unsync();
		expect(s.synced).toBe(false);
		expect(ids(s)).toEqual(['a:ready']);
	});

	test('eventOf lifts the generated oneof', () => {
		const snap = create(WatchVMsResponseSchema, {
			event: { case: 'snapshot', value: { vms: [vm('a')] } }
		});
		expect(eventOf(snap, 'vms')).toEqual({ case: 'snapshot', value: [vm('a')] });
		const rm = create(WatchVMsResponseSchema, { event: { case: 'removedId', value: 'a' } });
		expect(eventOf(rm, 'vms')).toEqual({ case: 'removedId', value: 'a' });
	});
});
