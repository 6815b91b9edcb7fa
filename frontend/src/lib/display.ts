// Display rules: how the console turns wire facts into words. Kept free of
// Svelte so every rule is unit-tested on its own.
import type { Timestamp } from '@bufbuild/protobuf/wkt';
import type { VM } from '@eitri/sdk/vm_pb';
import { ImageReadiness, type Image } from '@eitri/sdk/images_pb';
import type { ExposureSessions } from '@eitri/sdk/resources_pb';
import { isNarrated, Lifecycle } from './vmstate';

/** Tone drives the colour of a status dot; the word always says the same thing. */
export type Tone = 'ok' | 'busy' | 'bad' | 'idle' | 'muted';

const lifecycles: Record<Lifecycle, { word: string; tone: Tone }> = {
	pending: { word: 'pending', tone: 'busy' },
	creating: { word: 'creating', tone: 'busy' },
	ready: { word: 'ready', tone: 'ok' },
	stopped: { word: 'stopped', tone: 'idle' },
	failed: { word: 'failed', tone: 'bad' },
	deleting: { word: 'deleting', tone: 'muted' },
	unknown: { word: 'unknown — host not reporting', tone: 'muted' },
	// Its host was decommissioned by force: nothing runs it anywhere.
	lost: { word: 'lost — host decommissioned', tone: 'bad' },
	// A request on its way: shown from the moment it is made until the
	// host's report confirms it.
	starting: { word: 'starting', tone: 'busy' },
	stopping: { word: 'stopping', tone: 'busy' },
	restoring: { word: 'restoring', tone: 'busy' },
	retrying: { word: 'retrying', tone: 'busy' },
	// Its guest ended unasked and the host boots it again: something went
	// wrong, and the host's sentence says what.
	restarting: { word: 'restarting', tone: 'bad' }
};

function isLifecycle(s: string): s is Lifecycle {
	return Object.hasOwn(lifecycles, s);
}

/** The word for a VM's lifecycle. A value this console does not know yet is
 *  shown as sent rather than guessed at; an empty one is "unknown". */
export function lifecycleWord(lifecycle: string): string {
	if (isLifecycle(lifecycle)) return lifecycles[lifecycle].word;
	return lifecycle || lifecycles.unknown.word;
}

export function lifecycleTone(lifecycle: string): Tone {
	return isLifecycle(lifecycle) ? lifecycles[lifecycle].tone : 'muted';
}

type VMStatusFields = Pick<VM, 'lifecycle' | 'deleted' | 'statusDetail' | 'lastError'> & Partial<Pick<VM, 'restorableUntil'>>;

/** Whether RestoreVM can still bring a deleted VM back at now. The control
 *  plane closes restores at restorable_until, a margin before it tells the
 *  host to destroy the disk; a Restore offered after that could only fail.
 *  A deleted VM that does not say (an older control plane) is taken as
 *  restorable: the control plane still refuses what it must. */
export function canRestore(vm: Pick<VM, 'deleted'> & Partial<Pick<VM, 'restorableUntil'>>, now: Date): boolean {
	if (!vm.deleted) return false;
	const until = tsDate(vm.restorableUntil);
	return until === null || now.getTime() < until.getTime();
}

/** The status cell's main text. A soft-deleted VM can still be brought back
 *  until restorable_until, and saying so is the point of the row. */
export function vmStatusWord(vm: VMStatusFields, now: Date = new Date()): string {
	if (vm.deleted) return canRestore(vm, now) ? 'deleting — restorable' : 'deleting — being destroyed';
	return lifecycleWord(vm.lifecycle);
}

export function vmStatusTone(vm: VMStatusFields): Tone {
	return vm.deleted ? 'muted' : lifecycleTone(vm.lifecycle);
}

/** The host's narration under a VM's status. Narration describes work in
 *  flight (a create, a start or stop, a restart after a crash), so only such
 *  a VM gets it; a settled VM shows nothing even when a stale sentence
 *  arrives with it. '' means no line. */
export function vmDetail(vm: VMStatusFields): string {
	if (!isNarrated(vm)) return '';
	return vm.statusDetail.trim();
}

/** Whether RetryVM can work: only a failed VM is tried again. */
export function canRetry(vm: Pick<VM, 'lifecycle' | 'deleted'>): boolean {
	return !vm.deleted && vm.lifecycle === Lifecycle.failed;
}

/** A timeline event's message as a line and, when it carries some (a
 *  guest that ended unasked: its serial console), the lines under it. */
export function eventParts(message: string): { line: string; more: string } {
	const i = message.indexOf('\n');
	if (i < 0) return { line: message, more: '' };
	return { line: message.slice(0, i), more: message.slice(i + 1).replace(/\s+$/, '') };
}

/** Why a failed VM failed, in its host's words, or how a lost VM was lost;
 *  '' for any other VM. */
export function vmError(vm: VMStatusFields): string {
	if (vm.deleted || (vm.lifecycle !== Lifecycle.failed && vm.lifecycle !== Lifecycle.lost)) return '';
	return vm.lastError;
}

/** What an exposure's port has carried, or null when nobody counted. Zeros are
 *  a reported fact and are shown; absence is silence and must not become
 *  zeros, so an agent that counts sessions but not bytes gets no bytes
 *  clause. The totals reset with the agent, hence the closing clause. */
export function sessionSummary(s: ExposureSessions | null | undefined): string | null {
	if (!s) return null;
	const bytes = s.carried ? ` · ${formatBytes(s.carried.in)} in, ${formatBytes(s.carried.out)} out` : '';
	return `${s.active} open · ${s.refused} refused, ${s.dropped} dropped${bytes} since agent start`;
}

const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];

/** Binary-unit byte count: "512 B", "1.2 GiB", "37 GiB", "120 GiB". One
 *  decimal below ten units, where it still says something. */
export function formatBytes(bytes: number | bigint): string {
	let v = Number(bytes);
	if (!Number.isFinite(v) || v < 0) return '—';
	let i = 0;
	while (v >= 1024 && i < units.length - 1) {
		v /= 1024;
		i++;
	}
	if (i === 0) return `${v} B`;
	const text = v < 10 ? v.toFixed(1).replace(/\.0$/, '') : Math.round(v).toString();
	// Rounding 1023.6 up reads better as the next unit.
	if (text === '1024' && i < units.length - 1) return `1 ${units[i + 1]}`;
	return `${text} ${units[i]}`;
}

export const MiB = 1024 * 1024;
export const GiB = 1024 * MiB;

export function formatMB(mb: number | bigint): string {
	return formatBytes(Number(mb) * MiB);
}

export function formatGB(gb: number | bigint): string {
	return formatBytes(Number(gb) * GiB);
}

/** "2 vCPU · 2 GiB · 10 GiB disk" */
export function sizeLabel(v: { vcpus: number; memMb: bigint | number; diskGb: bigint | number }): string {
	return `${v.vcpus} vCPU · ${formatMB(v.memMb)} · ${formatGB(v.diskGb)} disk`;
}

/** host:port for people and for pasting; IPv6 in brackets. null when the host
 *  has not said where it is reachable. */
export function hostPort(addr: string, port: number): string | null {
	if (!addr) return null;
	return addr.includes(':') ? `[${addr}]:${port}` : `${addr}:${port}`;
}

/** The power cell: what the hypervisor says, and what was asked for when the
 *  two differ ("stopped → running"). Empty actual means nobody is reporting. */
export function powerText(vm: Pick<VM, 'actualPower' | 'powerState'>): string {
	const actual = vm.actualPower || 'not reported';
	if (vm.actualPower === vm.powerState) return actual;
	return `${actual} → ${vm.powerState}`;
}

export type Gauge = {
	/** 0..1 share of capacity allocated, or null when capacity is unknown. */
	fraction: number | null;
	over: boolean;
	text: string;
};

/** One capacity bar: what the control plane placed against what the host
 *  reported. Without a report there is no bar, only the allocation. */
export function gauge(
	allocated: number | bigint | undefined,
	capacity: number | bigint | undefined,
	fmt: (n: number | bigint) => string
): Gauge {
	const a = Number(allocated ?? 0);
	if (capacity === undefined) return { fraction: null, over: false, text: `${fmt(a)} allocated · capacity not reported` };
	const c = Number(capacity);
	const fraction = c > 0 ? Math.min(1, a / c) : a > 0 ? 1 : 0;
	return { fraction, over: a > c, text: `${fmt(a)} of ${fmt(c)}` };
}

export function formatCount(unit: string): (n: number | bigint) => string {
	return (n) => `${n} ${unit}`;
}

const dateTime = new Intl.DateTimeFormat(undefined, { dateStyle: 'medium', timeStyle: 'short' });

export function tsDate(ts: Timestamp | undefined): Date | null {
	if (!ts) return null;
	return new Date(Number(ts.seconds) * 1000 + Math.floor(ts.nanos / 1e6));
}

/** A timestamp for people; '' for an unset one (never the epoch). */
export function formatTime(ts: Timestamp | undefined): string {
	const d = tsDate(ts);
	return d ? dateTime.format(d) : '';
}

export type SizePreset = { name: string; vcpus: number; memMb: number; diskGb: number };

export const sizePresets: SizePreset[] = [
	{ name: 'tiny', vcpus: 1, memMb: 256, diskGb: 1 },
	{ name: 'small', vcpus: 1, memMb: 1024, diskGb: 10 },
	{ name: 'medium', vcpus: 2, memMb: 4096, diskGb: 20 },
	{ name: 'large', vcpus: 4, memMb: 8192, diskGb: 40 }
];

const readinessWords: Record<ImageReadiness, string> = {
	[ImageReadiness.UNSPECIFIED]: '',
	[ImageReadiness.CLOUD_INIT]: 'ready by cloud-init',
	[ImageReadiness.SSH]: 'ready by ssh',
	[ImageReadiness.ADDRESS]: 'ready at its address'
};

/** What a person choosing a catalogue image reads beside its name. */
export function imageFacts(img: Image): string {
	const p = img.properties;
	const parts: string[] = [];
	const os = [p?.os, p?.osVersion].filter(Boolean).join(' ');
	if (os) parts.push(os);
	if (p?.architecture) parts.push(p.architecture);
	const minMem = Number(p?.minMemMb ?? 0n);
	const minDisk = Number(p?.minDiskGb ?? 0n);
	if (minMem || minDisk) {
		const need: string[] = [];
		if (minMem) need.push(formatMB(minMem));
		if (minDisk) need.push(`${formatGB(minDisk)} disk`);
		parts.push(`needs ${need.join(', ')}`);
	}
	const size = Number(img.current?.size ?? 0n);
	if (size) parts.push(`${formatBytes(size)} download`);
	if (img.current) parts.push(`version ${img.current.version}`);
	const ready = p ? readinessWords[p.readiness] : '';
	if (ready) parts.push(ready);
	if (img.hosts.length) {
		const held = img.hosts.filter((h) => h.state === 'held').length;
		parts.push(`held by ${held} of ${img.hosts.length} ${img.hosts.length === 1 ? 'host' : 'hosts'}`);
	}
	return parts.join(' · ');
}
