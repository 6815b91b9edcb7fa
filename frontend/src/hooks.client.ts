import { primeMe } from '$lib/session';

// Ask who we are while the route's code is still loading, so the first
// screen does not wait for the modules and then for /auth/me in turn.
export function init() {
	primeMe();
}
