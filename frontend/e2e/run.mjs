// End-to-end test of the console against a real `eitri dev`.
//
// The outer process (root) makes a network namespace and a temp dir, then runs
// this same file again inside the namespace ("--inside"). The inner process
// starts everything on the namespace's loopback: a slow image server, `eitri
// dev` (bridge, taps, NAT, DHCP, QEMU guests), and Debian's Chromium driven by
// playwright-core. Whatever happens, the outer process then kills every pid
// left in the namespace, deletes it and removes the temp dir.
//
//   EITRI_BIN=bin/eitri EITRI_GUEST=.cache/guest node frontend/e2e/run.mjs
//
// Screenshots (and, on failure, the dev log) go to frontend/e2e/artifacts/.
import { spawn, spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { createServer } from 'node:http';
import { createWriteStream, existsSync, readFileSync, statSync } from 'node:fs';
import { copyFile, mkdir, mkdtemp, readFile, rm } from 'node:fs/promises';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const ARTIFACTS = join(HERE, 'artifacts');
const CHROMIUM = '/usr/bin/chromium';
const LISTEN = '127.0.0.1:18090';
const BASE = `http://${LISTEN}`;
const IMAGE_SIZE = 72 << 20; // past 32 MiB, so the host narrates progress
const CHUNK = 4 << 20;
const CHUNK_EVERY_MS = 150;
const OVERALL_MS = 10 * 60_000;

const log = (...a) => console.log('e2e:', ...a);

if (process.argv[2] === '--inside') {
	process.exitCode = await inside(process.argv[3], process.argv[4]);
} else {
	process.exitCode = await outside();
}

// ---------------------------------------------------------------- outside

function skip(reason) {
	console.log(`e2e: skipped: ${reason}`);
	return 0;
}

function onPath(cmd) {
	return spawnSync('sh', ['-c', `command -v ${cmd}`], { stdio: 'ignore' }).status === 0;
}

async function outside() {
	if (process.getuid?.() !== 0) return skip('needs root (network namespace, bridge, taps)');
	if (!existsSync(CHROMIUM)) return skip(`${CHROMIUM} is missing (apt-get install chromium)`);
	if (!onPath('qemu-system-x86_64')) return skip('qemu-system-x86_64 is missing');
	if (!onPath('ip')) return skip('ip (iproute2) is missing');
	const bin = process.env.EITRI_BIN && resolve(process.env.EITRI_BIN);
	if (!bin || !existsSync(bin)) return skip(`EITRI_BIN ${bin ? bin + ' does not exist' : 'is not set'} (make build)`);
	const guest = process.env.EITRI_GUEST && resolve(process.env.EITRI_GUEST);
	if (!guest || !existsSync(join(guest, 'eitri-guest.raw')))
		return skip(`no eitri-guest.raw in EITRI_GUEST ${guest ?? '(not set)'} (make guest-image)`);
	try {
		await import('playwright-core');
	} catch {
		return skip('playwright-core is not installed (npm ci)');
	}

	const ns = `eitri-ui-${process.pid.toString(16)}`;
	const tmp = await mkdtemp(join(tmpdir(), 'eitri-ui-'));
	let child;
	let cleaned = false;
	const cleanup = async () => {
		if (cleaned) return;
		cleaned = true;
		if (child && child.exitCode === null) child.kill('SIGTERM');
		// Everything still in the namespace (dev, QEMU, Chromium, servers) goes.
		for (let i = 0; i < 3; i++) {
			const pids = nsPids(ns);
			if (pids.length === 0) break;
			for (const p of pids) {
				try {
					process.kill(p, 'SIGKILL');
				} catch {}
			}
			await sleep(300);
		}
		spawnSync('ip', ['netns', 'del', ns], { stdio: 'ignore' });
		await rm(tmp, { recursive: true, force: true });
	};
	const onSignal = async (sig) => {
		console.error(`e2e: ${sig}, cleaning up`);
		await cleanup();
		process.exit(1);
	};
	process.once('SIGINT', onSignal);
	process.once('SIGTERM', onSignal);

	const mk = spawnSync('ip', ['netns', 'add', ns], { encoding: 'utf8' });
	if (mk.status !== 0) {
		console.error(`e2e: ip netns add ${ns}: ${mk.stderr.trim()}`);
		console.log('e2e: 0 passed, 1 failed');
		await rm(tmp, { recursive: true, force: true });
		return 1;
	}
	try {
		spawnSync('ip', ['netns', 'exec', ns, 'ip', 'link', 'set', 'lo', 'up'], { stdio: 'inherit' });
		child = spawn('ip', ['netns', 'exec', ns, process.execPath, fileURLToPath(import.meta.url), '--inside', bin, guest], {
			stdio: 'inherit',
			// Chromium's profile (playwright makes one per launch) lands in our temp dir.
			env: { ...process.env, TMPDIR: tmp, E2E_TMP: tmp, E2E_NS: ns }
		});
		const timer = setTimeout(() => {
			console.error(`e2e: gave up after ${OVERALL_MS / 1000} s`);
			child.kill('SIGKILL');
		}, OVERALL_MS);
		const code = await new Promise((r) => child.on('exit', (c, s) => r(c ?? (s ? 1 : 1))));
		clearTimeout(timer);
		return code;
	} finally {
		await cleanup();
	}
}

function nsPids(ns) {
	const r = spawnSync('ip', ['netns', 'pids', ns], { encoding: 'utf8' });
	return (r.stdout ?? '')
		.split(/\s+/)
		.filter(Boolean)
		.map(Number)
		.filter((p) => p !== process.pid);
}

function sleep(ms) {
	return new Promise((r) => setTimeout(r, ms));
}

// ---------------------------------------------------------------- inside

async function inside(bin, guest) {
	const tmp = process.env.E2E_TMP;
	const results = [];
	const check = async (name, fn) => {
		const t = Date.now();
		try {
			await fn();
			results.push({ name, ok: true });
			log(`PASS ${name} (${((Date.now() - t) / 1000).toFixed(1)} s)`);
			return true;
		} catch (e) {
			results.push({ name, ok: false });
			log(`FAIL ${name}: ${e?.message?.split('\n').slice(0, 6).join('\n    ') ?? e}`);
			return false;
		}
	};
	const fail = (name, why) => {
		results.push({ name, ok: false });
		log(`FAIL ${name}: ${why}`);
	};

	await rm(ARTIFACTS, { recursive: true, force: true });
	await mkdir(ARTIFACTS, { recursive: true });

	const image = await slowImageServer(join(guest, 'eitri-guest.raw'));
	log(`slow image ${image.url} (${IMAGE_SIZE >> 20} MiB, sha256 ${image.sha256.slice(0, 12)}…)`);

	const devLog = join(tmp, 'dev.log');
	const dataDir = join(tmp, 'data');
	const dev = spawn(
		bin,
		[
			'dev',
			'--listen', LISTEN,
			'--data-dir', dataDir,
			'--bridge', 'eitriui0',
			'--subnet', '10.81.0.1/24',
			'--guest-image', guest,
			'--delete-grace', '5s'
		],
		{ stdio: ['ignore', 'pipe', 'pipe'] }
	);
	const devOut = createWriteStream(devLog);
	dev.stdout.pipe(devOut);
	dev.stderr.pipe(devOut);
	let devExited = null;
	dev.on('exit', (c, s) => (devExited = s ?? c));

	const { chromium } = await import('playwright-core');
	let browser;
	let failed = false;
	try {
		const token = await waitForDev(dataDir, () => devExited);
		log('eitri dev is up');

		browser = await chromium.launch({
			executablePath: CHROMIUM,
			headless: true,
			args: [
				'--no-sandbox',
				'--disable-gpu',
				'--disable-background-networking',
				'--disable-component-update',
				'--disable-sync',
				'--no-first-run'
			]
		});
		const ctx = await browser.newContext({ viewport: { width: 1280, height: 900 } });
		const page = await ctx.newPage();
		page.setDefaultTimeout(20_000);
		page.on('pageerror', (e) => console.error('e2e: page error:', e.message));
		// Before sign-in, /auth/me answers 401 by design; that one is not news.
		let signedIn = false;
		page.on('console', (m) => {
			if (m.type() !== 'error' || (!signedIn && /status of 401/.test(m.text()))) return;
			console.error('e2e: console:', m.text());
		});
		const requests = [];
		page.on('request', (r) => {
			const u = new URL(r.url());
			requests.push({ t: Date.now(), method: r.method(), path: u.pathname, done: false, req: r });
		});
		for (const ev of ['requestfinished', 'requestfailed'])
			page.on(ev, (r) => {
				const x = requests.findLast((q) => q.req === r);
				if (x) x.done = true;
			});
		const shot = (name) => page.screenshot({ path: join(ARTIFACTS, `${name}.png`), fullPage: true });
		const failShot = (name) => shot(`FAILED-${name}`).catch(() => {});

		// 1. Log in.
		const loggedIn = await check('log in with the admin token; the local host is connected with capacity bars', async () => {
			await page.goto(BASE + '/login');
			await page.getByLabel('Access token').waitFor();
			await shot('login');
			await page.getByLabel('Access token').fill(token);
			await page.getByRole('button', { name: 'Sign in' }).click();
			await page.waitForURL(BASE + '/', { timeout: 15_000 });
			signedIn = true;
			await page.getByRole('heading', { name: 'Fleet', level: 1 }).waitFor();
			const hostRow = page.locator('section[aria-labelledby="hosts-h"] tbody tr').first();
			// The agent enrolls and reports capacity a moment after start.
			await waitFor(
				async () => {
					const text = (await hostRow.textContent({ timeout: 1000 }).catch(() => '')) ?? '';
					return /\bconnected\b/.test(text) && !/not connected/.test(text) && (await hostRow.getByRole('meter').count()) === 3;
				},
				60_000,
				'the host row shows "connected" and three capacity meters (CPU, Memory, Disk)'
			);
			for (const m of ['CPU allocated', 'Memory allocated', 'Disk allocated']) {
				const v = await hostRow.getByRole('meter', { name: m }).getAttribute('aria-valuetext');
				if (!v || !/ of /.test(v)) throw new Error(`meter "${m}" says ${JSON.stringify(v)}, want "<allocated> of <reported>"`);
			}
			await page.getByText('live', { exact: true }).waitFor();
			await shot('fleet-empty');
		}).then(async (ok) => ok || (await failShot('login'), false));
		if (!loggedIn) throw new Error('cannot go on without a session');

		// 2. Create a VM from the form; watch it narrate and become ready.
		let vmReady = false;
		let vmId = '';
		await check('create a VM: "downloading image" then ready with a 10.81.0.x address, without reloading', async () => {
			await page.getByRole('heading', { name: /^VMs/ }).getByRole('link', { name: 'New VM' }).click();
			await page.getByRole('heading', { name: 'New VM', level: 1 }).waitFor();
			await page.getByRole('button', { name: 'Use the built-in test image' }).waitFor();
			await shot('create-vm');
			await page.getByLabel('Name', { exact: true }).fill('ui-1');
			await page.getByLabel('Image URL').fill(image.url);
			await page.getByLabel('SHA-256').fill(image.sha256);
			await page.getByRole('group', { name: 'Size presets' }).getByRole('button').first().click();
			// A marker that a reload would wipe: everything below must be pushed.
			await page.evaluate(() => (window.__e2eNoReload = true));
			await page.getByRole('button', { name: 'Create VM' }).click();
			await page.waitForURL(/\/vms\/[^/]+$/, { timeout: 15_000 });
			vmId = page.url().split('/').pop();
			await page.getByRole('heading', { name: 'ui-1', level: 1 }).waitFor();
			// Every distinct status line the page shows, as it is pushed.
			await page.evaluate(() => {
				const seen = (window.__e2eStatus = []);
				const read = () => {
					const dt = [...document.querySelectorAll('dl.facts dt')].find((d) => d.textContent.trim() === 'Status');
					const t = dt?.nextElementSibling?.textContent.trim().replace(/\s+/g, ' ');
					if (t && seen[seen.length - 1] !== t) seen.push(t);
				};
				read();
				new MutationObserver(read).observe(document.body, { subtree: true, childList: true, characterData: true });
			});
			const status = factsValue(page, 'Status');
			await status.getByText(/downloading image/).waitFor({ timeout: 60_000 });
			await shot('vm-detail-downloading');
			await factsValue(page, 'Address').getByText(/^10\.81\.0\.\d+$/).waitFor({ timeout: 180_000 });
			const word = (await status.textContent())?.trim().replace(/\s+/g, ' ');
			if (!/^ready$/.test(word ?? '')) throw new Error(`status is "${word}" once the address is set, want "ready" alone`);
			if (!(await page.evaluate(() => window.__e2eNoReload === true))) throw new Error('the page reloaded');
			const seen = await page.evaluate(() => window.__e2eStatus);
			log(`status lines seen: ${seen.map((t) => JSON.stringify(t)).join(' → ')}`);
			if (!seen.some((t) => /downloading image \d+(\.\d+)?\/72(\.0)? MiB/.test(t)))
				throw new Error('no "downloading image N/72 MiB" progress line was shown');
			vmReady = true;
			log(`ready at ${(await factsValue(page, 'Address').locator('.mono').textContent())?.trim()}`);
			await shot('vm-detail');
		}).then(async (ok) => ok || (await failShot('create-vm'), false));

		// 3. Publish a port and watch its session counters move.
		if (!vmReady) fail('publish a port and see the session summary change', 'no ready VM');
		else
			await check('publish guest port 80 (tcp, local); connections move the session summary without reloading', async () => {
				await page.getByLabel('Guest port').fill('80');
				await page.getByLabel('Protocol').selectOption('tcp');
				await page.getByLabel('Scope').selectOption('local');
				await page.getByRole('button', { name: 'Publish port' }).click();
				const row = page.locator('section[aria-labelledby="exp-h"] tbody tr').filter({ hasText: 'tcp · local' });
				await row.waitFor({ timeout: 15_000 });
				const remove = row.getByRole('button', { name: /^Remove published port \d+$/ });
				const port = Number((await remove.getAttribute('aria-label')).match(/\d+$/)[0]);
				await row.getByText('active', { exact: true }).waitFor({ timeout: 30_000 });
				const summaryRe = /(\d+) open · (\d+) refused, (\d+) dropped since agent start/;
				const traffic = row.locator('td[data-label="Traffic"]');
				const before = ((await traffic.textContent()) ?? '').trim();
				log(`exposure on 127.0.0.1:${port}, summary before: ${JSON.stringify(before)}`);
				// Three short HTTP requests, and one connection held open.
				for (let i = 0; i < 3; i++) {
					const body = await httpGet(`http://127.0.0.1:${port}/`);
					if (!/hostname=ui-1/.test(body)) throw new Error(`guest answered ${JSON.stringify(body.slice(0, 80))}, want hostname=ui-1`);
				}
				const held = await openSocket(port);
				try {
					await waitFor(
						async () => {
							const t = ((await traffic.textContent()) ?? '').trim();
							const m = t.match(summaryRe);
							return m && t !== before && Number(m[1]) >= 1;
						},
						20_000,
						'the summary shows the held connection as open'
					);
					log(`summary with one open: ${((await traffic.textContent()) ?? '').trim()}`);
					await shot('vm-detail-exposure');
				} finally {
					held.destroy();
				}
				await waitFor(
					async () => ((await traffic.textContent()) ?? '').match(summaryRe)?.[1] === '0',
					20_000,
					'the summary goes back to 0 open after the connection closes'
				);
				log(`summary after close: ${((await traffic.textContent()) ?? '').trim()}`);
				if (!(await page.evaluate(() => window.__e2eNoReload === true))) throw new Error('the page reloaded');
			}).then(async (ok) => ok || (await failShot('exposure'), false));

		// 5. Screenshots of the remaining pages (client-side navigation).
		await check('hosts and tokens pages render (screenshots)', async () => {
			const nav = page.getByRole('navigation', { name: 'Main' });
			await nav.getByRole('link', { name: 'Hosts' }).click();
			await page.getByRole('heading', { name: 'Hosts', level: 1 }).waitFor();
			await page.getByRole('button', { name: 'Create join token' }).click();
			await page.getByLabel('Command to run on the new host').getByText(/eitri agent/).waitFor();
			await shot('hosts');
			await nav.getByRole('link', { name: 'Tokens' }).click();
			await page.getByRole('heading', { name: 'Access tokens', level: 1 }).waitFor();
			await page.locator('main tbody tr').first().waitFor();
			await shot('tokens');
		}).then(async (ok) => ok || (await failShot('pages'), false));

		// 4. Idle: nothing is polled.
		await check('idle fleet page makes no API request for 10 s (streams stay open)', async () => {
			await page.goto(BASE + '/');
			await page.locator('table.vms tbody tr').first().waitFor();
			await page.getByText('live', { exact: true }).waitFor();
			await sleep(1500);
			await shot('fleet');
			const from = Date.now();
			await sleep(10_000);
			const during = requests.filter((r) => r.t >= from);
			const api = during.filter((r) => r.path.startsWith('/eitri.v1.') || r.path.startsWith('/auth/'));
			const watches = requests.filter((r) => r.t < from && /\/Watch[A-Za-z]+$/.test(r.path) && !r.done);
			log(`idle: ${during.length} requests in 10 s; ${watches.length} watch streams open (${[...new Set(watches.map((w) => w.path.split('/').pop()))].join(', ')})`);
			if (api.length) {
				const counts = {};
				for (const r of api) counts[r.path] = (counts[r.path] ?? 0) + 1;
				throw new Error(`API requests while idle: ${JSON.stringify(counts)}`);
			}
			if (!watches.some((w) => w.path.endsWith('/WatchVMs')) || !watches.some((w) => w.path.endsWith('/WatchHosts')))
				throw new Error('the fleet page has no open WatchVMs/WatchHosts stream');
		}).then(async (ok) => ok || (await failShot('idle'), false));
	} catch (e) {
		failed = true;
		log(`aborted: ${e?.message ?? e}`);
	} finally {
		await browser?.close().catch(() => {});
		image.close();
		await stopDev(dev);
		devOut.end();
	}
	const failures = results.filter((r) => !r.ok).length + (failed ? 1 : 0);
	if (failures) {
		await copyFile(devLog, join(ARTIFACTS, 'dev.log')).catch(() => {});
		log(`dev log copied to ${join(ARTIFACTS, 'dev.log')}`);
	}
	log(`screenshots in ${ARTIFACTS}`);
	console.log(`e2e: ${results.filter((r) => r.ok).length} passed, ${failures} failed`);
	return failures ? 1 : 0;
}

// The value cell (<dd>) after a <dt> in the VM detail's facts list.
function factsValue(page, term) {
	return page.locator('dl.facts dt').filter({ hasText: new RegExp(`^${term}$`) }).locator('xpath=following-sibling::dd[1]');
}

async function waitFor(fn, ms, what) {
	const end = Date.now() + ms;
	for (;;) {
		if (await fn().catch(() => false)) return;
		if (Date.now() > end) throw new Error(`timed out after ${ms / 1000} s waiting until ${what}`);
		await sleep(200);
	}
}

async function waitForDev(dataDir, exited) {
	const tokenFile = join(dataDir, 'control', 'admin.token');
	const end = Date.now() + 60_000;
	for (;;) {
		if (exited() !== null) throw new Error(`eitri dev exited (${exited()}) before it was up`);
		try {
			const r = await fetch(BASE + '/healthz');
			if (r.ok && existsSync(tokenFile)) {
				const token = readFileSync(tokenFile, 'utf8').trim();
				if (token) return token;
			}
		} catch {}
		if (Date.now() > end) throw new Error('eitri dev was not up within 60 s');
		await sleep(200);
	}
}

async function stopDev(dev) {
	if (dev.exitCode !== null || dev.signalCode !== null) return;
	dev.kill('SIGTERM');
	const done = new Promise((r) => dev.once('exit', r));
	if ((await Promise.race([done.then(() => true), sleep(20_000).then(() => false)])) === false) {
		log('eitri dev did not stop in 20 s; killing it');
		dev.kill('SIGKILL');
		await done;
	}
}

// Serves the guest image padded with zeros to IMAGE_SIZE, slowly, so the host
// has time to narrate the download.
async function slowImageServer(raw) {
	const size = statSync(raw).size;
	if (size > IMAGE_SIZE) throw new Error(`${raw} is larger than ${IMAGE_SIZE} bytes`);
	const data = Buffer.alloc(IMAGE_SIZE);
	(await readFile(raw)).copy(data);
	const sha256 = createHash('sha256').update(data).digest('hex');
	const server = createServer(async (req, res) => {
		if (req.url !== '/guest.raw') {
			res.writeHead(404).end();
			return;
		}
		res.writeHead(200, { 'content-type': 'application/octet-stream', 'content-length': String(data.length) });
		for (let off = 0; off < data.length && !res.destroyed; off += CHUNK) {
			res.write(data.subarray(off, off + CHUNK));
			await sleep(CHUNK_EVERY_MS);
		}
		res.end();
	});
	await new Promise((r) => server.listen(0, '127.0.0.1', r));
	return {
		url: `http://127.0.0.1:${server.address().port}/guest.raw`,
		sha256,
		close: () => {
			server.close();
			server.closeAllConnections?.();
		}
	};
}

async function httpGet(url) {
	const ac = new AbortController();
	const t = setTimeout(() => ac.abort(), 10_000);
	try {
		const r = await fetch(url, { signal: ac.signal, headers: { connection: 'close' } });
		return await r.text();
	} finally {
		clearTimeout(t);
	}
}

function openSocket(port) {
	return new Promise((res, rej) => {
		const s = net.connect(port, '127.0.0.1', () => res(s));
		s.on('error', rej);
		s.setTimeout(60_000, () => s.destroy());
	});
}
