import { describe, expect, test } from 'vitest';
import { create, type MessageInitShape } from '@bufbuild/protobuf';
import { VMSchema } from '@eitri/sdk/vm_pb';
import { ProgressSchema } from '@eitri/sdk/resources_pb';
import { formatEta, progressView, rateText, trackRate, vmProgress, type RateState } from './progress';

const GiB = 1024n ** 3n;
const MiB = 1024n ** 2n;
const prog = (f: MessageInitShape<typeof ProgressSchema> = {}) => create(ProgressSchema, { step: 'download', ...f });
const vm = (f: MessageInitShape<typeof VMSchema> = {}) => create(VMSchema, { id: 'vm-1', name: 'web-1', lifecycle: 'creating', ...f });

describe('vmProgress', () => {
	test('a download of known size is a bar with bytes and a percentage', () => {
		const v = vmProgress(vm({ progress: { step: 'download', doneBytes: 1_288_490_188n, totalBytes: 3_972_844_748n } }));
		expect(v).toEqual({ label: 'image download', fraction: 1_288_490_188 / 3_972_844_748, percent: 32, text: '1.2 GiB of 3.7 GiB · 32%' });
	});

	test('no total is an indeterminate bar with the bytes so far', () => {
		expect(vmProgress(vm({ progress: { step: 'download', doneBytes: 2n * GiB } }))).toEqual({
			label: 'image download',
			fraction: null,
			percent: null,
			text: '2 GiB so far'
		});
	});

	test('no progress is no bar, never "0 of 0"', () => {
		expect(vmProgress(vm({ statusDetail: 'preparing root disk' }))).toBeNull();
	});

	test.each(['ready', 'stopped', 'failed', 'pending', ''])('a %s VM shows no bar even when a stale measure arrives', (lifecycle) => {
		expect(vmProgress(vm({ lifecycle, progress: { step: 'download', doneBytes: 1n, totalBytes: 2n } }))).toBeNull();
	});

	test('a deleted VM shows no bar', () => {
		expect(vmProgress(vm({ deleted: true, progress: { step: 'download', doneBytes: 1n, totalBytes: 2n } }))).toBeNull();
	});

	test('a retried create shows its download', () => {
		expect(vmProgress(vm({ lifecycle: 'retrying', progress: { step: 'download', doneBytes: 1n, totalBytes: 2n } }))?.percent).toBe(50);
	});
});

describe('progressView', () => {
	test.each([
		['just started', 0n, 100n * MiB, 0, '0 B of 100 MiB · 0%'],
		['99.6% is not done', 996n * MiB, 1000n * MiB, 99, '996 MiB of 1000 MiB · 99%'],
		['whole', 3n * GiB, 3n * GiB, 100, '3 GiB of 3 GiB · 100%']
	])('%s', (_, done, total, percent, text) => {
		const v = progressView(prog({ doneBytes: done, totalBytes: total }));
		expect(v.percent).toBe(percent);
		expect(v.text).toBe(text);
	});

	test('done past the total is clamped to a full bar', () => {
		const v = progressView(prog({ doneBytes: 9n * GiB, totalBytes: GiB }));
		expect(v.fraction).toBe(1);
		expect(v.percent).toBe(100);
	});

	test('a zero total is read as unknown', () => {
		expect(progressView(prog({ doneBytes: 5n * MiB, totalBytes: 0n })).fraction).toBeNull();
	});

	test('a step this console does not know is shown without a label', () => {
		const v = progressView(prog({ step: 'snapshot', doneBytes: MiB, totalBytes: 2n * MiB }));
		expect(v.label).toBe('');
		expect(v.text).toBe('1 MiB of 2 MiB · 50%');
	});

	test('a hostile step cannot pick a label off the prototype', () => {
		expect(progressView(prog({ step: 'constructor', doneBytes: 1n })).label).toBe('');
	});
});

describe('trackRate', () => {
	const at = (done: bigint, total?: bigint) => prog({ doneBytes: done, totalBytes: total });

	test('the first sample has no rate; the second gives one', () => {
		const s1 = trackRate(null, at(0n), 0);
		expect(s1).toEqual({ step: 'download', at: 0, done: 0, rate: null });
		const s2 = trackRate(s1, at(10n * MiB), 1000);
		expect(s2?.rate).toBe(10 * 1024 * 1024);
	});

	test('later samples are smoothed', () => {
		let s = trackRate(null, at(0n), 0);
		s = trackRate(s, at(10n * MiB), 1000); // 10 MiB/s
		s = trackRate(s, at(30n * MiB), 2000); // 20 MiB/s this second
		expect(s?.rate).toBeCloseTo((0.3 * 20 + 0.7 * 10) * 1024 * 1024);
	});

	test('samples too close together are folded into the next', () => {
		const s1 = trackRate(null, at(0n), 0);
		expect(trackRate(s1, at(MiB), 100)).toBe(s1);
	});

	test('an unchanged count is not a sample', () => {
		const s1 = trackRate(trackRate(null, at(0n), 0), at(MiB), 1000);
		expect(trackRate(s1, at(MiB), 5000)).toBe(s1);
	});

	test('a download that starts over starts the rate over', () => {
		const s1 = trackRate(trackRate(null, at(0n), 0), at(50n * MiB), 1000);
		expect(trackRate(s1, at(MiB), 2000)).toEqual({ step: 'download', at: 2000, done: 1024 * 1024, rate: null });
	});

	test('a new step starts the rate over', () => {
		const s1 = trackRate(trackRate(null, at(0n), 0), at(50n * MiB), 1000);
		expect(trackRate(s1, prog({ step: 'snapshot', doneBytes: 60n * MiB }), 2000)?.rate).toBeNull();
	});

	test('no measure, no rate', () => {
		const s1 = trackRate(null, at(0n), 0);
		expect(trackRate(s1, undefined, 1000)).toBeNull();
	});
});

describe('rateText', () => {
	const state = (rate: number | null): RateState => ({ step: 'download', at: 0, done: 0, rate });

	test('rate and time left when the total is known', () => {
		expect(rateText(state(10 * 1024 * 1024), prog({ doneBytes: 0n, totalBytes: 1800n * MiB }))).toBe('10 MiB/s · about 3 min left');
	});
	test('only the rate without a total', () => {
		expect(rateText(state(10 * 1024 * 1024), prog({ doneBytes: 0n }))).toBe('10 MiB/s');
	});
	test('nothing until there is a rate', () => {
		expect(rateText(state(null), prog({ doneBytes: 0n, totalBytes: 1n }))).toBe('');
		expect(rateText(null, prog({ doneBytes: 0n }))).toBe('');
		expect(rateText(state(0), prog({ doneBytes: 0n, totalBytes: 1n }))).toBe('');
	});
});

describe('formatEta', () => {
	test.each([
		[0.5, 'almost done'],
		[1, '1 s left'],
		[42.2, '43 s left'],
		[60, 'about 1 min left'],
		[3599, 'about 60 min left'],
		[3600, 'about 1 h left'],
		[5400, 'about 1 h 30 min left'],
		[7170, 'about 2 h left'],
		[86400, 'more than a day left'],
		[-1, ''],
		[Infinity, '']
	])('%s s: %s', (s, want) => {
		expect(formatEta(s)).toBe(want);
	});
});
