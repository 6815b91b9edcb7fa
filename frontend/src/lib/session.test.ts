import { describe, expect, test } from 'vitest';
import { fetchMe } from './session';

const answering = (status: number, body: string) => (async () => new Response(body, { status })) as unknown as typeof fetch;

describe('fetchMe', () => {
	test('a signed-out answer is signed out', async () => {
		expect(await fetchMe(answering(200, '{"signedIn":false}'))).toEqual({ kind: 'signed-out' });
	});
	test('a signed-in answer names who', async () => {
		expect(await fetchMe(answering(200, '{"signedIn":true,"name":"alice","admin":false}'))).toEqual({
			kind: 'signed-in',
			me: { name: 'alice', admin: false }
		});
	});
	test('an error status is an error, with the server\'s message', async () => {
		expect(await fetchMe(answering(500, '{"message":"internal error"}'))).toEqual({ kind: 'error', message: 'internal error' });
	});
	test('a body that is not JSON is an error, not a guess', async () => {
		expect((await fetchMe(answering(200, '<html>'))).kind).toBe('error');
	});
	test('an unreachable server is an error', async () => {
		const down = (async () => {
			throw new TypeError('fetch failed');
		}) as unknown as typeof fetch;
		expect(await fetchMe(down)).toEqual({ kind: 'error', message: 'the control plane cannot be reached' });
	});
});
