import { describe, expect, test } from 'vitest';
import { create } from '@bufbuild/protobuf';
import { timestampFromDate } from '@bufbuild/protobuf/wkt';
import { HostSchema } from '@eitri/sdk/host_pb';
import { forceWaitMs } from './hostgone';

const now = new Date('2026-12-02T12:00:00Z');
const ago = (min: number) => timestampFromDate(new Date(now.getTime() - min * 60_000));

describe('forceWaitMs', () => {
	test('a connected host is never forced out', () => {
		expect(forceWaitMs(create(HostSchema, { connected: true, lastSeenAt: ago(60) }), now)).toBeNull();
	});
	test('a host gone a few minutes has to wait the rest of ten', () => {
		expect(forceWaitMs(create(HostSchema, { lastSeenAt: ago(4) }), now)).toBe(6 * 60_000);
	});
	test('a host gone ten minutes or more may be forced out', () => {
		expect(forceWaitMs(create(HostSchema, { lastSeenAt: ago(10) }), now)).toBe(0);
		expect(forceWaitMs(create(HostSchema, { lastSeenAt: ago(600) }), now)).toBe(0);
	});
	test('a host never seen counts from its enrolment', () => {
		expect(forceWaitMs(create(HostSchema, { createdAt: ago(3) }), now)).toBe(7 * 60_000);
	});
});
