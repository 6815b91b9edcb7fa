// The cookie session: a pasted token is exchanged for an HttpOnly cookie by
// the server; the console never stores the token itself.

export type Me = { name: string; admin: boolean };

export type MeResult = { kind: 'signed-in'; me: Me } | { kind: 'signed-out' } | { kind: 'error'; message: string };

async function textOf(r: Response): Promise<string> {
	const t = (await r.text().catch(() => '')).trim();
	// A JSON error body ({"message": "..."} or Connect's shape) reads better unwrapped.
	try {
		const j = JSON.parse(t);
		if (j && typeof j.message === 'string') return j.message;
	} catch {
		/* plain text */
	}
	return t;
}

let primed: Promise<Response> | null = null;

function requestMe(f: typeof fetch): Promise<Response> {
	return f('/auth/me', { credentials: 'same-origin', headers: { accept: 'application/json' } });
}

/** Starts the first /auth/me early; the next fetchMe() takes its answer. */
export function primeMe(f: typeof fetch = fetch): void {
	primed = requestMe(f);
	primed.catch(() => {});
}

export async function fetchMe(f: typeof fetch = fetch): Promise<MeResult> {
	let r: Response;
	try {
		const pending = primed;
		primed = null;
		r = await (pending ?? requestMe(f));
	} catch {
		return { kind: 'error', message: 'the control plane cannot be reached' };
	}
	if (!r.ok) return { kind: 'error', message: (await textOf(r)) || `the server answered ${r.status}` };
	// Signed out is an answer, not an error status, so a signed-out visit
	// leaves no error in the browser's console.
	let me: Partial<Me & { signedIn: boolean }>;
	try {
		me = await r.json();
	} catch {
		return { kind: 'error', message: 'the server did not say who is signed in' };
	}
	if (me?.signedIn !== true) return { kind: 'signed-out' };
	return { kind: 'signed-in', me: { name: String(me.name ?? ''), admin: Boolean(me.admin) } };
}

/** Returns '' on success, else why the token was not accepted. */
export async function login(token: string, f: typeof fetch = fetch): Promise<string> {
	let r: Response;
	try {
		r = await f('/auth/login', {
			method: 'POST',
			credentials: 'same-origin',
			headers: { 'content-type': 'application/json' },
			body: JSON.stringify({ token: token.trim() })
		});
	} catch {
		return 'the control plane cannot be reached';
	}
	if (r.ok) return '';
	const text = await textOf(r);
	if (r.status === 401 || r.status === 403) return text || 'that token was not accepted';
	return text || `the server answered ${r.status}`;
}

/** Returns '' on success, else what went wrong. */
export async function logout(f: typeof fetch = fetch): Promise<string> {
	try {
		const r = await f('/auth/logout', { method: 'POST', credentials: 'same-origin' });
		if (r.ok || r.status === 401) return '';
		return (await textOf(r)) || `the server answered ${r.status}`;
	} catch {
		return 'the control plane cannot be reached';
	}
}

export type GuestImage = { url: string; sha256: string };

/** The built-in test image, when this server offers one; null otherwise. */
export async function fetchGuestImage(f: typeof fetch = fetch): Promise<GuestImage | null> {
	try {
		const r = await f('/guest-image.json', { credentials: 'same-origin' });
		if (r.status !== 200) return null;
		const j = (await r.json()) as Partial<GuestImage>;
		if (typeof j.url !== 'string' || typeof j.sha256 !== 'string' || !j.url) return null;
		return { url: j.url, sha256: j.sha256 };
	} catch {
		return null;
	}
}
