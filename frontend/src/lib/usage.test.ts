import { describe, expect, it } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { timestampFromMs } from '@bufbuild/protobuf/wkt';
import { HostUsageSchema, NetUsageSchema, VMUsageSchema, type VMUsage } from '@eitri/sdk/usage_pb';
import { appendSample, formatBytes, formatPercent, hostSeries, latest, vmSeries, windowPoints } from './usage';

const vm = (sec: number, cpu?: number, sent?: number, hostId = 'h1'): VMUsage =>
	create(VMUsageSchema, {
		vmId: 'vm-1',
		hostId,
		at: timestampFromMs(sec * 1000),
		cpuSeconds: cpu,
		memoryRssBytes: 300n << 20n,
		net: sent === undefined ? undefined : create(NetUsageSchema, { sentBytes: BigInt(sent), receivedBytes: 0n })
	});

describe('vmSeries', () => {
	it('turns counters into rates between samples', () => {
		const s = vmSeries([vm(100, 10, 0), vm(110, 15, 10240), vm(120, 25, 20480)]);
		expect(s.t).toEqual([100, 110, 120]);
		expect(s.cpu).toEqual([null, 50, 100]);
		expect(s.netOut).toEqual([null, 1024, 1024]);
		expect(s.mem).toEqual([300 * 2 ** 20, 300 * 2 ** 20, 300 * 2 ** 20]);
	});
	it('leaves what was not measured as a gap, never 0', () => {
		const s = vmSeries([vm(100, 10), vm(110, undefined), vm(120, 12)]);
		expect(s.cpu).toEqual([null, null, null]);
		expect(s.diskRead).toEqual([null, null, null]);
		expect(s.netIn).toEqual([null, null, null]);
	});
	it('draws no rate across a counter that went back', () => {
		expect(vmSeries([vm(100, 500), vm(110, 1)]).cpu).toEqual([null, null]);
	});
});

describe('hostSeries', () => {
	it('gives CPU as a share of all the host CPUs and memory in use', () => {
		const h = (sec: number, busy: number) =>
			create(HostUsageSchema, {
				hostId: 'h1',
				at: timestampFromMs(sec * 1000),
				cpus: 2,
				cpuBusySeconds: busy,
				memoryTotalBytes: 8n << 30n,
				memoryAvailableBytes: 6n << 30n
			});
		const s = hostSeries([h(0, 100), h(10, 105)]);
		expect(s.cpu).toEqual([null, 25]);
		expect(s.memUsed).toEqual([2 * 2 ** 30, 2 * 2 ** 30]);
	});
});

describe('appendSample', () => {
	it('keeps the newest window of points', () => {
		let w: VMUsage[] = [];
		for (let i = 0; i < windowPoints + 5; i++) w = appendSample(w, vm(i, i));
		expect(w).toHaveLength(windowPoints);
		expect(w[0].cpuSeconds).toBe(5);
	});
	it('starts over when the VM is measured by another host', () => {
		const w = appendSample(appendSample([], vm(1, 1)), vm(2, 2, undefined, 'h2'));
		expect(w.map((s) => s.hostId)).toEqual(['h2']);
	});
});

it('formats what it has and a dash for what it has not', () => {
	expect(latest([1, 2, null])).toBe(2);
	expect(latest([null])).toBeNull();
	expect(formatPercent(12.345)).toBe('12.3%');
	expect(formatPercent(null)).toBe('—');
	expect(formatBytes(1536)).toBe('1.5 KiB');
});
