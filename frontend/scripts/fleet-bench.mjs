// Fleet-page benchmark: serves the built console next to a scripted Connect
// API on loopback (N VMs, a changed VM every 1000/RATE ms), drives Debian's
// Chromium with playwright-core, and reports first load, frame rate and long
// tasks while updates stream in, plus whether any request repeats while idle.
// It also saves a screenshot of each page (light and dark) to test-results/.
//
//   npm run build && node scripts/fleet-bench.mjs [--vms 1000] [--rate 20] [--seconds 10]
//
// The API here is a stand-in for `eitri dev` that can produce a fleet of a
// thousand VMs on demand; it speaks the Connect protocol's JSON form by hand.
import { createServer } from 'node:http';
import { readFile, mkdir } from 'node:fs/promises';
import { extname, join, normalize } from 'node:path';
import { parseArgs } from 'node:util';
import { chromium } from 'playwright-core';

const { values: args } = parseArgs({
	options: {
		vms: { type: 'string', default: '1000' },
		rate: { type: 'string', default: '20' },
		seconds: { type: 'string', default: '10' },
		shots: { type: 'string', default: 'test-results' },
		// Only serve (console + scripted API) until killed, for poking at by hand.
		serve: { type: 'boolean', default: false }
	}
});
const N = Number(args.vms);
const RATE = Number(args.rate);
const SECONDS = Number(args.seconds);

// protojson: Timestamps are RFC 3339 strings.
const now = (plusSeconds = 0) => new Date(Date.now() + plusSeconds * 1000).toISOString();
const hosts = ['alpha', 'bravo', 'charlie'].map((name, i) => ({
	id: `h-${i}`,
	name,
	address: i === 2 ? 'fd00::12' : `192.0.2.${10 + i}`,
	agentVersion: 'v0.3.1',
	accelerator: i === 1 ? 'tcg' : 'kvm',
	connected: i !== 2,
	capacity: i === 2 ? undefined : { vcpus: 32, memMb: '131072', diskGb: '2000' },
	allocated: { vcpus: 12 + i * 30, memMb: String(40960 + i * 20000), diskGb: '640' },
	createdAt: now(),
	lastSeenAt: now()
}));
const lifecycles = ['ready', 'ready', 'ready', 'stopped', 'creating', 'failed', 'pending'];
let vms = Array.from({ length: N }, (_, i) => makeVM(i, 0));
function makeVM(i, tick) {
	const lifecycle = i === 0 ? 'creating' : lifecycles[(i + tick) % lifecycles.length];
	return {
		id: `vm-${String(i).padStart(5, '0')}`,
		name: `web-${i}`,
		hostId: `h-${i % 3}`,
		imageUrl: 'https://images.example/debian-12.qcow2',
		imageSha256: 'a'.repeat(64),
		vcpus: 1 + (i % 4),
		memMb: String(1024 * (1 + (i % 4))),
		diskGb: '10',
		powerState: lifecycle === 'stopped' ? 'stopped' : 'running',
		status: lifecycle,
		lastError: lifecycle === 'failed' ? 'image sha256 mismatch' : '',
		assignedIp: lifecycle === 'ready' ? `10.77.${(i >> 8) & 255}.${i & 255}` : '',
		createdAt: now(),
		deleted: i === 3,
		actualPower: lifecycle === 'stopped' ? 'stopped' : lifecycle === 'ready' ? 'running' : '',
		phase: lifecycle,
		statusDetail: lifecycle === 'creating' ? `downloading image ${((tick % 37) / 10).toFixed(1)}/3.7 GiB` : '',
		destroyAt: i === 3 ? now(86400) : undefined,
		lifecycle: i === 3 ? 'deleting' : lifecycle,
		sshAuthorizedKey:
			'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIzUPnMzYig98JsArCMRgaSipeWYxWpnf98LHBcyUEvp test@eitri',
		sshHostPubkey: lifecycle === 'ready' ? 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIIzUPnMzYig98JsArCMRgaSipeWYxWpnf98LHBcyUEvp' : '',
		ownerId: 'u-1'
	};
}
const exposures = [
	{ id: 'x-1', vmId: 'vm-00000', hostId: 'h-0', guestPort: 80, hostPort: 30080, hostAddr: '192.0.2.10', protocol: 'tcp', scope: 'lan', state: 'active', reason: '', sessions: { active: '7', refused: '12', dropped: '3' }, createdAt: now() },
	{ id: 'x-2', vmId: 'vm-00000', hostId: 'h-0', guestPort: 53, hostPort: 30053, hostAddr: 'fd00::12', protocol: 'udp', scope: 'lan', state: 'pending', reason: '', createdAt: now() },
	{ id: 'x-3', vmId: 'vm-00000', hostId: 'h-0', guestPort: 22, hostPort: 2222, hostAddr: '', protocol: 'tcp', scope: 'local', state: 'failed', reason: 'listen tcp :2222: address already in use', createdAt: now() }
];

function frame(obj, flags = 0) {
	const body = Buffer.from(JSON.stringify(obj));
	const head = Buffer.alloc(5);
	head[0] = flags;
	head.writeUInt32BE(body.length, 1);
	return Buffer.concat([head, body]);
}

const requests = [];
const openStreams = new Set();
let refuse = 0; // refuse this many stream opens (to exercise backoff)
function stream(req, res, first, every, next) {
	if (refuse > 0) {
		refuse--;
		res.writeHead(503, { 'content-type': 'application/json' });
		return res.end(JSON.stringify({ code: 'unavailable', message: 'control plane restarting' }));
	}
	openStreams.add(res);
	res.on('close', () => openStreams.delete(res));
	res.writeHead(200, { 'content-type': 'application/connect+json' });
	res.write(frame(first));
	if (!every) return;
	const t = setInterval(() => res.write(frame(next())), every);
	req.on('close', () => clearInterval(t));
}
function unary(res, obj) {
	res.writeHead(200, { 'content-type': 'application/json' });
	res.end(JSON.stringify(obj));
}

let tick = 0;
const api = {
	'/eitri.v1.VMService/WatchVMs': (req, res) =>
		stream(req, res, { snapshot: { vms } }, 1000 / RATE, () => {
			tick++;
			// VM 0 narrates its download; others change lifecycle at random.
			const i = tick % 2 ? 0 : Math.floor(Math.random() * N);
			vms[i] = makeVM(i, tick);
			return { changed: vms[i] };
		}),
	'/eitri.v1.HostService/WatchHosts': (req, res) => stream(req, res, { snapshot: { hosts } }),
	'/eitri.v1.ExposureService/WatchExposures': (req, res) => stream(req, res, { snapshot: { exposures } }),
	'/eitri.v1.HostService/ListHosts': (_req, res) => unary(res, { hosts }),
	'/eitri.v1.VMService/ListVMEvents': (_req, res) =>
		unary(res, {
			events: [
				{ at: now(), kind: 'created', message: 'created by admin' },
				{ at: now(), kind: 'status', message: 'pending → creating' }
			]
		}),
	'/eitri.v1.TokenService/ListTokens': (_req, res) =>
		unary(res, {
			tokens: [
				{ id: 't-1', name: 'first start', userId: 'u-1', userName: 'admin', createdAt: now(), lastUsedAt: now() },
				{ id: 't-2', name: 'ci', userId: 'u-2', userName: 'robot', createdAt: now(), expiresAt: now(30 * 86400) }
			]
		}),
	'/eitri.v1.HostService/CreateJoinToken': (_req, res) =>
		unary(res, { token: 'ejt_abc', expiresAt: now(3600), command: 'eitri agent --join ejt_abc --data /var/lib/eitri' }),
	'/eitri.v1.HostService/DecommissionHost': (_req, res) => {
		res.writeHead(400, { 'content-type': 'application/json' });
		res.end(JSON.stringify({ code: 'failed_precondition', message: 'host alpha still has 334 VMs' }));
	}
};

const types = { '.js': 'text/javascript', '.css': 'text/css', '.html': 'text/html', '.svg': 'image/svg+xml' };
const server = createServer(async (req, res) => {
	const url = new URL(req.url, 'http://x');
	requests.push({ t: Date.now(), method: req.method, path: url.pathname });
	if (url.pathname === '/auth/me') return unary(res, { signedIn: true, name: 'admin', admin: true });
	if (url.pathname === '/guest-image.json') return unary(res, { url: 'http://127.0.0.1/guest.raw.gz', sha256: 'b'.repeat(64) });
	const h = api[url.pathname];
	if (h) {
		req.resume();
		return h(req, res);
	}
	if (url.pathname.startsWith('/eitri.v1.')) {
		res.writeHead(501, { 'content-type': 'application/json' });
		return res.end(JSON.stringify({ code: 'unimplemented', message: `${url.pathname} is not scripted` }));
	}
	const path = normalize(url.pathname).replace(/^\/+/, '') || 'index.html';
	try {
		const body = await readFile(join('build', path));
		res.writeHead(200, { 'content-type': types[extname(path)] ?? 'application/octet-stream' });
		res.end(body);
	} catch {
		res.writeHead(200, { 'content-type': 'text/html' });
		res.end(await readFile('build/index.html'));
	}
});
await new Promise((r) => server.listen(0, '127.0.0.1', r));
const base = `http://127.0.0.1:${server.address().port}`;
if (args.serve) {
	console.log(`serving ${base}`);
	await new Promise(() => {});
}

const browser = await chromium.launch({
	executablePath: '/usr/bin/chromium',
	args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking', '--disable-component-update', '--disable-sync', '--no-first-run']
});
try {
	const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
	page.on('pageerror', (e) => console.error('page error:', e.message));
	page.on('console', (m) => m.type() === 'error' && console.error('console:', m.text()));
	// Warm the browser process (not the page cache: a new context follows).
	const warm = await browser.newPage();
	await warm.goto(base + '/tokens');
	await warm.waitForSelector('main h1');
	await warm.close();
	const t0 = Date.now();
	await page.goto(base + '/');
	await page.waitForSelector('table.vms tbody tr', { timeout: 30_000 });
	const firstRowsMs = Date.now() - t0;
	await page
		.waitForFunction((n) => document.querySelectorAll('table.vms tbody tr').length === n, N, { timeout: 30_000 })
		.catch(async (e) => {
			await mkdir(args.shots, { recursive: true });
			await page.screenshot({ path: join(args.shots, 'fleet-timeout.png') });
			console.error('rows:', await page.evaluate(() => document.querySelectorAll('table.vms tbody tr').length));
			console.error(requests.slice(0, 40).map((r) => r.path).join('\n'));
			throw e;
		});
	const firstLoad = Date.now() - t0;
	const nav = await page.evaluate(() => {
		const e = performance.getEntriesByType('navigation')[0];
		const rs = performance.getEntriesByType('resource');
		return {
			domContentLoaded: Math.round(e.domContentLoadedEventEnd),
			load: Math.round(e.loadEventEnd),
			rowsAtMs: Math.round(performance.now()),
			api: rs.map((r) => `${new URL(r.name).pathname} start ${Math.round(r.startTime)} end ${Math.round(r.responseEnd)}`)
		};
	});
	await page.waitForSelector('text=live');

	// Frames and long tasks while updates stream in.
	const perf = await page.evaluate(async (ms) => {
		const longTasks = [];
		const po = new PerformanceObserver((l) => l.getEntries().forEach((e) => longTasks.push(e.duration)));
		po.observe({ type: 'longtask', buffered: false });
		let frames = 0;
		let worst = 0;
		let last = performance.now();
		const start = last;
		await new Promise((done) => {
			const step = (t) => {
				frames++;
				worst = Math.max(worst, t - last);
				last = t;
				if (t - start < ms) requestAnimationFrame(step);
				else done();
			};
			requestAnimationFrame(step);
		});
		po.disconnect();
		const secs = (performance.now() - start) / 1000;
		return {
			fps: +(frames / secs).toFixed(1),
			worstFrameMs: Math.round(worst),
			longTasks: longTasks.length,
			longTaskMs: Math.round(longTasks.reduce((a, b) => a + b, 0))
		};
	}, SECONDS * 1000);
	const detailShown = await page.locator('text=/downloading image \\d/').first().isVisible();

	// Drop every stream while web-5 is deleted behind the console's back: it
	// must show "reconnecting", come back "live", and the fresh snapshot must
	// drop web-5 without a reload.
	vms = vms.filter((v) => v.name !== 'web-5');
	refuse = 2;
	for (const r of openStreams) r.destroy();
	await page.waitForSelector('header >> text=reconnecting', { timeout: 5000 });
	await page.waitForSelector('header >> text=live', { timeout: 30_000 });
	await page.waitForFunction(() => ![...document.querySelectorAll('table.vms a')].some((a) => a.textContent === 'web-5'));
	const resumed = true;

	await mkdir(args.shots, { recursive: true });
	const shot = async (p, name, opts = {}) => {
		await p.screenshot({ path: join(args.shots, `${name}.png`), ...opts });
	};
	await shot(page, 'fleet');

	// Idle: a page with no updates must make no new requests.
	const idle = await browser.newPage({ viewport: { width: 1280, height: 900 } });
	await idle.goto(base + '/vms/vm-00001');
	await idle.waitForSelector('text=Published ports');
	await idle.waitForTimeout(500);
	const before = requests.length;
	await idle.waitForTimeout(3000);
	const idleRequests = requests.slice(before).filter((r) => r.path !== '/eitri.v1.VMService/ListVMEvents');

	const pages = [
		['/vms/vm-00000', 'vm-detail'],
		['/vms/new', 'create-vm'],
		['/hosts', 'hosts'],
		['/tokens', 'tokens']
	];
	for (const scheme of ['light', 'dark']) {
		const ctx = await browser.newContext({ colorScheme: scheme, viewport: { width: 1280, height: 900 } });
		const p = await ctx.newPage();
		p.on('dialog', (d) => d.accept());
		for (const [path, name] of pages) {
			await p.goto(base + path);
			await p.waitForSelector('main h1');
			if (name === 'hosts') {
				await p.click('text=Create join token');
				await p.waitForSelector('text=eitri agent --join');
				await p.click('button[aria-label="Decommission alpha"]');
				await p.waitForSelector('text=/decommission failed: host alpha still has/');
			}
			await p.waitForTimeout(300);
			await shot(p, `${name}-${scheme}`, { fullPage: true });
		}
		await ctx.close();
	}
	const phone = await browser.newContext({ viewport: { width: 390, height: 844 }, colorScheme: 'dark' });
	const pp = await phone.newPage();
	await pp.goto(base + '/vms/vm-00000');
	await pp.waitForSelector('text=Published ports');
	await shot(pp, 'vm-detail-phone');

	console.log(
		JSON.stringify(
			{ vms: N, updatesPerSecond: RATE, firstRowsMs, allRowsMs: firstLoad, navigation: nav, ...perf, detailShown, resumed, idleRequests: idleRequests.length },
			null,
			2
		)
	);
	if (idleRequests.length) console.error('requests while idle:', idleRequests);
} finally {
	await browser.close();
	server.close();
	server.closeAllConnections?.();
}
