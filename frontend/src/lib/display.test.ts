import { describe, expect, test } from 'vitest';
import { create, type MessageInitShape } from '@bufbuild/protobuf';
import { VMSchema } from '@eitri/sdk/vm_pb';
import { ImageReadiness, ImageSchema } from '@eitri/sdk/images_pb';
import { ExposureBytesSchema, ExposureSessionsSchema } from '@eitri/sdk/resources_pb';
import { timestampFromDate } from '@bufbuild/protobuf/wkt';
import {
	canRestore,
	canRetry,
	eventParts,
	formatBytes,
	formatGB,
	imageFacts,
	formatMB,
	gauge,
	hostPort,
	lifecycleWord,
	powerText,
	sessionSummary,
	sizeLabel,
	vmDetail,
	vmError,
	vmStatusTone,
	vmStatusWord
} from './display';
import { sha256, sshFingerprint } from './sshkey';

const vm = (f: MessageInitShape<typeof VMSchema> = {}) =>
	create(VMSchema, { id: 'vm-1', name: 'web-1', lifecycle: 'ready', ...f });

describe('vmDetail', () => {
	test('a creating VM shows its host sentence', () => {
		expect(vmDetail(vm({ lifecycle: 'creating', statusDetail: 'downloading image 1.2/3.7 GiB' }))).toBe(
			'downloading image 1.2/3.7 GiB'
		);
	});

	test.each(['pending', 'ready', 'stopped', 'failed', 'deleting', 'unknown', ''])(
		'a %s VM shows no detail even when a stale one arrives',
		(lifecycle) => {
			expect(vmDetail(vm({ lifecycle, statusDetail: 'booting' }))).toBe('');
		}
	);

	test.each([
		['starting', 'waiting for an address'],
		['stopping', 'forcing off after 30 s'],
		['restarting', 'qemu exited (signal 9); restarting, attempt 1'],
		['restoring', 'starting'],
		['retrying', 'downloading image']
	])('a %s VM shows what its host is doing', (lifecycle, said) => {
		expect(vmDetail(vm({ lifecycle, statusDetail: said }))).toBe(said);
	});

	test('a creating VM whose host has nothing to add gets no line', () => {
		expect(vmDetail(vm({ lifecycle: 'creating', statusDetail: '' }))).toBe('');
	});

	test('a deleted VM shows no narration', () => {
		expect(vmDetail(vm({ lifecycle: 'creating', deleted: true, statusDetail: 'booting' }))).toBe('');
	});
});

describe('vmError', () => {
	test('a failed VM shows its last error', () => {
		expect(vmError(vm({ lifecycle: 'failed', lastError: 'sha256 mismatch' }))).toBe('sha256 mismatch');
	});
	test('a lost VM says how it was lost', () => {
		const why = 'lost: its host rack9 (h-1) was decommissioned by force';
		expect(vmError(vm({ lifecycle: 'lost', lastError: why }))).toBe(why);
		expect(vmStatusTone(vm({ lifecycle: 'lost' }))).toBe('bad');
	});
	test('a ready VM does not show an old error', () => {
		expect(vmError(vm({ lifecycle: 'ready', lastError: 'sha256 mismatch' }))).toBe('');
	});
});

describe('lifecycle words', () => {
	test.each([
		['pending', 'pending'],
		['creating', 'creating'],
		['ready', 'ready'],
		['stopped', 'stopped'],
		['failed', 'failed'],
		['deleting', 'deleting'],
		['unknown', 'unknown — host not reporting'],
		['lost', 'lost — host decommissioned'],
		['starting', 'starting'],
		['stopping', 'stopping'],
		['restarting', 'restarting'],
		['restoring', 'restoring'],
		['retrying', 'retrying'],
		['', 'unknown — host not reporting'],
		['migrating', 'migrating']
	])('%j reads %j', (lifecycle, word) => {
		expect(lifecycleWord(lifecycle)).toBe(word);
	});

	test('a deleted VM says it can still be restored', () => {
		expect(vmStatusWord(vm({ deleted: true, lifecycle: 'deleting' }))).toBe('deleting — restorable');
	});

	test('a deleted VM past restorable_until no longer offers a restore', () => {
		const until = new Date('2026-12-02T12:00:00Z');
		const d = vm({ deleted: true, lifecycle: 'deleting', restorableUntil: timestampFromDate(until) });
		expect(canRestore(d, new Date(until.getTime() - 1000))).toBe(true);
		expect(vmStatusWord(d, new Date(until.getTime() - 1000))).toBe('deleting — restorable');
		expect(canRestore(d, until)).toBe(false);
		expect(vmStatusWord(d, until)).toBe('deleting — being destroyed');
		expect(canRestore(vm({ deleted: false, lifecycle: 'ready' }), until)).toBe(false);
	});
});

describe('requests in flight', () => {
	test.each(['starting', 'stopping', 'restoring', 'retrying'])('a VM %s is busy, not settled', (lifecycle) => {
		expect(vmStatusTone(vm({ lifecycle }))).toBe('busy');
	});

	test('a guest restarted after it ended unasked reads as trouble', () => {
		expect(vmStatusTone(vm({ lifecycle: 'restarting' }))).toBe('bad');
	});

	test('only a failed VM offers a retry', () => {
		expect(canRetry(vm({ lifecycle: 'failed' }))).toBe(true);
		for (const lifecycle of ['ready', 'creating', 'retrying', 'restarting', 'stopped', 'lost', 'pending']) {
			expect(canRetry(vm({ lifecycle })), lifecycle).toBe(false);
		}
		expect(canRetry(vm({ lifecycle: 'failed', deleted: true }))).toBe(false);
	});

	test("an exit's console goes under its line", () => {
		const msg = 'qemu exited (signal 9); serial console:\n[    1.2] Run /init as init process\nudhcpc: started\n';
		expect(eventParts(msg)).toEqual({
			line: 'qemu exited (signal 9); serial console:',
			more: '[    1.2] Run /init as init process\nudhcpc: started'
		});
		expect(eventParts('ready → stopped')).toEqual({ line: 'ready → stopped', more: '' });
	});
});

describe('sessionSummary', () => {
	test('counted sessions are summarised', () => {
		const s = create(ExposureSessionsSchema, { active: 7n, refused: 12n, dropped: 3n });
		expect(sessionSummary(s)).toBe('7 open · 12 refused, 3 dropped since agent start');
	});
	test('reported zeros are a fact and are shown', () => {
		expect(sessionSummary(create(ExposureSessionsSchema))).toBe('0 open · 0 refused, 0 dropped since agent start');
		const none = create(ExposureSessionsSchema, { carried: create(ExposureBytesSchema) });
		expect(sessionSummary(none)).toBe('0 open · 0 refused, 0 dropped · 0 B in, 0 B out since agent start');
	});
	test('carried bytes read in binary units, each way', () => {
		const s = create(ExposureSessionsSchema, {
			active: 1n,
			carried: create(ExposureBytesSchema, { in: 1536n, out: 5n * 1024n ** 3n })
		});
		expect(sessionSummary(s)).toBe('1 open · 0 refused, 0 dropped · 1.5 KiB in, 5 GiB out since agent start');
	});
	test('uncounted sessions say nothing, not zero', () => {
		expect(sessionSummary(undefined)).toBeNull();
		expect(sessionSummary(null)).toBeNull();
	});
});

describe('formatBytes', () => {
	test.each([
		[0, '0 B'],
		[512, '512 B'],
		[1024, '1 KiB'],
		[1536, '1.5 KiB'],
		[1.2 * 2 ** 30, '1.2 GiB'],
		[3.7 * 2 ** 30, '3.7 GiB'],
		[37 * 2 ** 30, '37 GiB'],
		[1023.7 * 2 ** 20, '1 GiB'],
		[2n ** 40n, '1 TiB'],
		[-1, '—']
	])('%s bytes is %s', (n, want) => {
		expect(formatBytes(n)).toBe(want);
	});

	test('MB and GB helpers use binary units', () => {
		expect(formatMB(256n)).toBe('256 MiB');
		expect(formatMB(2048)).toBe('2 GiB');
		expect(formatGB(10n)).toBe('10 GiB');
		expect(sizeLabel({ vcpus: 2, memMb: 4096n, diskGb: 20n })).toBe('2 vCPU · 4 GiB · 20 GiB disk');
	});
});

describe('hostPort', () => {
	test.each([
		['192.168.0.190', 30080, '192.168.0.190:30080'],
		['fd00::1', 30080, '[fd00::1]:30080'],
		['', 30080, null]
	])('%j %d', (addr, port, want) => {
		expect(hostPort(addr, port)).toBe(want);
	});
});

describe('power and capacity', () => {
	test('power shows the pending change', () => {
		expect(powerText(vm({ actualPower: 'running', powerState: 'running' }))).toBe('running');
		expect(powerText(vm({ actualPower: 'stopped', powerState: 'running' }))).toBe('stopped → running');
		expect(powerText(vm({ actualPower: '', powerState: 'running' }))).toBe('not reported → running');
	});

	test('a gauge without a capacity report draws no bar', () => {
		const g = gauge(2, undefined, (n) => `${n}`);
		expect(g.fraction).toBeNull();
		expect(g.text).toContain('capacity not reported');
	});

	test('an overcommitted gauge is full and flagged', () => {
		const g = gauge(10n, 8n, (n) => `${n}`);
		expect(g).toEqual({ fraction: 1, over: true, text: '10 of 8' });
		expect(gauge(2, 8, (n) => `${n}`).fraction).toBe(0.25);
	});
});

describe('ssh fingerprints', () => {
	test('sha256 matches known vectors', () => {
		const hex = (b: Uint8Array) => [...b].map((x) => x.toString(16).padStart(2, '0')).join('');
		expect(hex(sha256(new TextEncoder().encode('')))).toBe(
			'e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855'
		);
		expect(hex(sha256(new TextEncoder().encode('a'.repeat(1000))))).toBe(
			'41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3'
		);
	});

	test('an authorized_keys line gets the ssh-keygen fingerprint', () => {
		// `ssh-keygen -lf` on this key prints SHA256:VsIYPFyWVaVkQkrZj0iar4SIg9qpB4b+fxovq4w431w.
		const key =
			'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIzUPnMzYig98JsArCMRgaSipeWYxWpnf98LHBcyUEvp test@eitri';
		expect(sshFingerprint(key)).toBe('SHA256:VsIYPFyWVaVkQkrZj0iar4SIg9qpB4b+fxovq4w431w (ed25519)');
		expect(sshFingerprint('not a key')).toBeNull();
	});
});

describe('imageFacts', () => {
	test('says what the image is, what it needs and how it is judged ready', () => {
		const img = create(ImageSchema, {
			name: 'debian-12',
			properties: { os: 'debian', osVersion: '12', architecture: 'amd64', minMemMb: 512n, minDiskGb: 3n, readiness: ImageReadiness.ADDRESS },
			current: { version: 2n, size: 400n * 1024n * 1024n }
		});
		expect(imageFacts(img)).toBe('debian 12 · amd64 · needs 512 MiB, 3 GiB disk · 400 MiB download · version 2 · ready at its address');
	});
	test('says how many of the hosts it was pulled to hold it', () => {
		const img = create(ImageSchema, {
			name: 'x',
			current: { version: 1n },
			hosts: [
				{ hostId: 'h1', state: 'held' },
				{ hostId: 'h2', state: 'pulling' }
			]
		});
		expect(imageFacts(img)).toBe('version 1 · held by 1 of 2 hosts');
	});
	test('says nothing it was not told', () => {
		expect(imageFacts(create(ImageSchema, { name: 'x', current: { version: 1n } }))).toBe('version 1');
	});
});
