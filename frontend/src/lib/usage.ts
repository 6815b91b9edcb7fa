// A VM's or host's usage samples turned into the series a chart draws:
// rates between consecutive samples (CPU percent, bytes per second) and
// gauges (memory). A figure the host did not measure is null — a gap in the
// line — never 0; so is the first sample's rate, and a rate across a counter
// that went back (the VM's QEMU started again).
import { timestampMs } from '@bufbuild/protobuf/wkt';
import type { HostUsage, VMUsage } from '@eitri/sdk/usage_pb';
import { formatBytes as bytesText } from './display';

/** Samples kept per VM and host: an hour at the agents' 10 s. */
export const windowPoints = 360;

export type VMSeries = {
	/** Unix seconds, by the host's clock. */
	t: number[];
	/** Percent of one CPU. */
	cpu: (number | null)[];
	/** Resident bytes. */
	mem: (number | null)[];
	diskRead: (number | null)[];
	diskWrite: (number | null)[];
	netIn: (number | null)[];
	netOut: (number | null)[];
};

export type HostSeries = {
	t: number[];
	/** Percent of all the host's CPUs. */
	cpu: (number | null)[];
	memUsed: (number | null)[];
	netIn: (number | null)[];
	netOut: (number | null)[];
};

const seconds = (s: { at?: Parameters<typeof timestampMs>[0] }) => (s.at ? timestampMs(s.at) / 1000 : 0);

function perSecond(prev: number | undefined, cur: number | undefined, dt: number): number | null {
	if (prev === undefined || cur === undefined || dt <= 0 || cur < prev) return null;
	return (cur - prev) / dt;
}

const num = (v: bigint | number | undefined) => (v === undefined ? undefined : Number(v));

/** Appends sample to a window, keeping the newest windowPoints. A sample
 *  from another host starts the window over: its counters are another
 *  QEMU's. */
export function appendSample<S extends { hostId: string }>(win: S[] | undefined, s: S): S[] {
	const base = win && win.length > 0 && win[win.length - 1].hostId === s.hostId ? win : [];
	const next = [...base, s];
	return next.length > windowPoints ? next.slice(next.length - windowPoints) : next;
}

export function vmSeries(samples: VMUsage[]): VMSeries {
	const out: VMSeries = { t: [], cpu: [], mem: [], diskRead: [], diskWrite: [], netIn: [], netOut: [] };
	samples.forEach((s, i) => {
		const p = i > 0 ? samples[i - 1] : undefined;
		const t = seconds(s);
		const dt = p ? t - seconds(p) : 0;
		out.t.push(t);
		const cpu = p ? perSecond(p.cpuSeconds, s.cpuSeconds, dt) : null;
		out.cpu.push(cpu === null ? null : cpu * 100);
		out.mem.push(num(s.memoryRssBytes) ?? null);
		out.diskRead.push(p ? perSecond(num(p.disk?.readBytes), num(s.disk?.readBytes), dt) : null);
		out.diskWrite.push(p ? perSecond(num(p.disk?.writeBytes), num(s.disk?.writeBytes), dt) : null);
		out.netIn.push(p ? perSecond(num(p.net?.receivedBytes), num(s.net?.receivedBytes), dt) : null);
		out.netOut.push(p ? perSecond(num(p.net?.sentBytes), num(s.net?.sentBytes), dt) : null);
	});
	return out;
}

export function hostSeries(samples: HostUsage[]): HostSeries {
	const out: HostSeries = { t: [], cpu: [], memUsed: [], netIn: [], netOut: [] };
	samples.forEach((s, i) => {
		const p = i > 0 ? samples[i - 1] : undefined;
		const t = seconds(s);
		const dt = p ? t - seconds(p) : 0;
		out.t.push(t);
		const busy = p && s.cpus > 0 ? perSecond(p.cpuBusySeconds, s.cpuBusySeconds, dt) : null;
		out.cpu.push(busy === null ? null : (busy * 100) / s.cpus);
		const total = num(s.memoryTotalBytes);
		const avail = num(s.memoryAvailableBytes);
		out.memUsed.push(total !== undefined && avail !== undefined ? Math.max(0, total - avail) : null);
		out.netIn.push(p ? perSecond(num(p.net?.receivedBytes), num(s.net?.receivedBytes), dt) : null);
		out.netOut.push(p ? perSecond(num(p.net?.sentBytes), num(s.net?.sentBytes), dt) : null);
	});
	return out;
}

/** The newest value that is not null, for a caption or a sparkline's label. */
export function latest(values: (number | null)[]): number | null {
	for (let i = values.length - 1; i >= 0; i--) {
		const v = values[i];
		if (v !== null) return v;
	}
	return null;
}

export function formatPercent(v: number | null): string {
	return v === null ? '—' : `${v.toFixed(1)}%`;
}

/** A measured byte count in the console's one byte format; "—" when it
 *  was not measured. */
export function formatBytes(v: number | null): string {
	return v === null ? '—' : bytesText(v);
}

export const formatRate = (v: number | null) => (v === null ? '—' : `${formatBytes(v)}/s`);
