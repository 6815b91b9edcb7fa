import { describe, expect, test } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { HostSchema, HostUpgradeSchema, type HostUpgrade } from '@eitri/sdk/host_pb';
import { RolloutSchema, RolloutHostSchema } from '@eitri/sdk/release_pb';
import { VMSchema } from '@eitri/sdk/vm_pb';
import { activeRollout, hostLink, rolloutLine, trustWarning, upgradeNote } from './upgrade';

const host = (upgrade?: Partial<Omit<HostUpgrade, '$typeName'>>, connected = true) =>
	create(HostSchema, { connected, upgrade: upgrade ? create(HostUpgradeSchema, upgrade) : undefined });

describe('hosts', () => {
	test('a disconnected host is offline', () => {
		expect(hostLink(host(undefined, false))).toBe('offline');
		expect(hostLink(host())).toBe('connected');
	});

	test('an upgrade in flight says what the host is doing', () => {
		expect(upgradeNote(host({ target: 'v1.4', step: 'downloading', detail: 'downloading agent v1.4 12/40 MiB' }))).toBe(
			'upgrading to v1.4: downloading agent v1.4 12/40 MiB'
		);
		expect(upgradeNote(host({ target: 'v1.4', step: 'offered' }))).toBe('upgrading to v1.4: offered');
	});

	test('a failed upgrade says why, a finished one and a stuck one say nothing here', () => {
		expect(upgradeNote(host({ target: 'v1.4', step: 'failed', error: 'exited at start' }))).toBe(
			'upgrade to v1.4 failed: exited at start'
		);
		expect(upgradeNote(host({ target: 'v1.4', step: 'done' }))).toBe('');
		// The stuck condition carries the sentence; saying it twice is noise.
		expect(upgradeNote(host({ target: 'v1.4', step: 'offered', stuck: true }))).toBe('');
		expect(upgradeNote(host())).toBe('');
	});
});

describe('rollouts', () => {
	const ro = (id: string, seconds: bigint, state: string) =>
		create(RolloutSchema, {
			id,
			version: 'v1.4',
			state,
			createdAt: { seconds, nanos: 0 },
			hosts: [create(RolloutHostSchema, { state: 'done' }), create(RolloutHostSchema, { state: 'upgrading' })]
		});

	test('the newest rollout shows while it acts, and not once it ended', () => {
		expect(activeRollout([ro('a', 1n, 'aborted'), ro('b', 2n, 'rolling')])?.id).toBe('b');
		expect(activeRollout([ro('a', 1n, 'rolling'), ro('b', 2n, 'done')])).toBeUndefined();
		expect(activeRollout([])).toBeUndefined();
	});

	test('a halted rollout says why', () => {
		const r = ro('a', 1n, 'halted');
		r.reason = 'host a failed to upgrade: exited at start';
		expect(rolloutLine(r)).toBe('Upgrading to v1.4: halted, 1/2 hosts done — host a failed to upgrade: exited at start');
	});
});

describe('vms', () => {
	test('a VM trusting only a rotated-out CA is flagged with its fix', () => {
		expect(trustWarning(create(VMSchema, { trustStale: true, trustFix: 'recreate the VM' }))).toBe('stale SSH trust: recreate the VM');
		expect(trustWarning(create(VMSchema, {}))).toBe('');
	});
});
