// Progress rules: how the console draws a VM's measured step (VM.progress)
// as a bar, and how fast it goes. Drawn only from the numbers, never from the
// host's sentence, and kept free of Svelte so every rule is unit-tested.
import type { VM } from '@eitri/sdk/vm_pb';
import type { Progress } from '@eitri/sdk/resources_pb';
import { formatBytes } from './display';
import { isNarrated } from './vmstate';

export type ProgressView = {
	/** What is measured, for people and screen readers; '' for a step this
	 *  console does not know (the counters are shown without a label). */
	label: string;
	/** 0..1 when the total is known; null draws an indeterminate bar. */
	fraction: number | null;
	/** Whole percent, rounded down (99.6% is not done), or null. */
	percent: number | null;
	/** "1.2 GiB of 3.7 GiB · 32%", or "1.2 GiB so far" without a total. */
	text: string;
};

const stepLabels: Record<string, string> = { download: 'image download' };

/** The bar for a VM, or null when there is none to draw: the host measures
 *  nothing (progress unset — never shown as "0 of 0"), or the VM is not
 *  doing work its host narrates (a stale measure on a settled VM). */
export function vmProgress(vm: Pick<VM, 'lifecycle' | 'deleted' | 'progress'>): ProgressView | null {
	if (!vm.progress || !isNarrated(vm)) return null;
	return progressView(vm.progress);
}

export function progressView(p: Progress): ProgressView {
	const label = Object.hasOwn(stepLabels, p.step) ? stepLabels[p.step] : '';
	const done = Number(p.doneBytes);
	// A zero total says nothing a bar could use; a host never sends one.
	const total = p.totalBytes !== undefined && p.totalBytes > 0n ? Number(p.totalBytes) : null;
	if (total === null) return { label, fraction: null, percent: null, text: `${formatBytes(done)} so far` };
	// Clamped: an older control plane may pass on a done past the total.
	const fraction = Math.min(1, Math.max(0, done / total));
	const percent = Math.floor(fraction * 100);
	return { label, fraction, percent, text: `${formatBytes(done)} of ${formatBytes(total)} · ${percent}%` };
}

/** What the rate is worked out from: the last sample and the smoothed rate
 *  (bytes per second, null until two samples). */
export type RateState = { step: string; at: number; done: number; rate: number | null };

/** Samples closer than this are folded into the next: a burst of updates
 *  would otherwise make the rate jump around. */
const minSampleMs = 250;
/** Weight of the newest sample in the smoothed rate. */
const smoothing = 0.3;

/** The rate state after a new measure p seen at nowMs (milliseconds). A new
 *  step, or done going back (a download that had to start over), starts
 *  afresh; no measure means no rate. An unchanged count is not a sample:
 *  the same VM redrawn for another reason says nothing about its speed. */
export function trackRate(prev: RateState | null, p: Progress | undefined, nowMs: number): RateState | null {
	if (!p) return null;
	const done = Number(p.doneBytes);
	if (!prev || prev.step !== p.step || done < prev.done) return { step: p.step, at: nowMs, done, rate: null };
	const dt = nowMs - prev.at;
	if (done === prev.done || dt < minSampleMs) return prev;
	const sample = ((done - prev.done) * 1000) / dt;
	const rate = prev.rate === null ? sample : smoothing * sample + (1 - smoothing) * prev.rate;
	return { step: p.step, at: nowMs, done, rate };
}

/** "12 MiB/s · about 3 min left": the rate, and the time left when the total
 *  is known; '' until there is a rate. */
export function rateText(state: RateState | null, p: Progress | undefined): string {
	if (!state || state.rate === null || !p || state.rate <= 0) return '';
	const rate = `${formatBytes(Math.round(state.rate))}/s`;
	if (p.totalBytes === undefined || p.totalBytes <= 0n) return rate;
	const left = Math.max(0, Number(p.totalBytes) - Number(p.doneBytes)) / state.rate;
	return `${rate} · ${formatEta(left)}`;
}

/** Time left in words, coarse on purpose: a rate that moves makes seconds
 *  precision a lie past the first minute. */
export function formatEta(seconds: number): string {
	if (!Number.isFinite(seconds) || seconds < 0) return '';
	if (seconds < 1) return 'almost done';
	if (seconds < 60) return `${Math.ceil(seconds)} s left`;
	if (seconds < 3600) return `about ${Math.round(seconds / 60)} min left`;
	if (seconds < 86400) {
		const h = Math.floor(seconds / 3600);
		const m = Math.round((seconds % 3600) / 60);
		return m === 0 || m === 60 ? `about ${m === 60 ? h + 1 : h} h left` : `about ${h} h ${m} min left`;
	}
	return 'more than a day left';
}
