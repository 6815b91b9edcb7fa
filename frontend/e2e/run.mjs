// End-to-end test of the console against a real `eitri dev`.
//
// The outer process (root) makes two network namespaces and a temp dir, then
// runs this same file again inside the first ("--inside"), the dev namespace.
// The inner process starts, on that namespace's loopback, a slow image server
// and `eitri dev` (bridge, taps, NAT, DHCP, QEMU guests). Debian's Chromium,
// driven by playwright-core, runs in the second, the browser namespace, and
// reaches the console at the same URL through a relay (see startRelay).
// Whatever happens, the outer process then kills every pid left in either
// namespace, deletes both and removes the temp dir.
//
// Why Chromium has a namespace of its own: Chromium watches its namespace's
// links and addresses over netlink, and when they change it aborts requests in
// flight with net::ERR_NETWORK_CHANGED. In the dev namespace they change all
// the time: the agent makes its bridge at start and a tap for every VM it
// boots. Nothing in the browser namespace ever changes after the outer process
// has set up its loopback, before anything starts, so Chromium has no network
// change to see, whatever the agent does and whenever it does it.
//
//   EITRI_BIN=bin/eitri EITRI_GUEST=.cache/guest node frontend/e2e/run.mjs
//
// Screenshots (and, on failure, the dev log and the guests' serial logs) go to
// frontend/e2e/artifacts/.
import { spawn, spawnSync } from 'node:child_process';
import { createHash } from 'node:crypto';
import { createWriteStream, existsSync, readFileSync, statSync, writeFileSync } from 'node:fs';
import { copyFile, mkdir, mkdtemp, readdir, readFile, rm, writeFile } from 'node:fs/promises';
import http from 'node:http';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { basename, dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const HERE = dirname(fileURLToPath(import.meta.url));
const ARTIFACTS = join(HERE, 'artifacts');
const CHROMIUM = '/usr/bin/chromium';
const LISTEN = '127.0.0.1:18090';
const BASE = `http://${LISTEN}`;
const IMAGE_SIZE = 72 << 20; // past 32 MiB, so the host narrates progress
const CHUNK = 4 << 20;
const CHUNK_EVERY_MS = 150;
// The image server holds the download here (past the host's first 32 MiB
// progress step) until the test has seen the progress line; see slowImageServer.
const HOLD_AT = 36 << 20;
const HOLD_TRICKLE = 64 << 10; // a second while held
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
	if (!onPath('socat')) return skip('socat is missing (apt-get install socat)');
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

	const ns = `eitri-ui-${process.pid.toString(16)}`; // dev, agent, QEMU, image server
	const bns = `eitri-uib-${process.pid.toString(16)}`; // Chromium, and nothing that changes links
	const namespaces = [ns, bns];
	const tmp = await mkdtemp(join(tmpdir(), 'eitri-ui-'));
	let child;
	let cleaning;
	const cleanup = () =>
		(cleaning ??= (async () => {
			if (child && child.exitCode === null && child.signalCode === null) child.kill('SIGKILL');
			// Everything still in either namespace (dev, QEMU, Chromium, relays,
			// servers) goes; again until none is left, as a dying process may
			// have started another.
			for (let i = 0; ; i++) {
				const pids = namespaces.flatMap(nsPids);
				if (pids.length === 0) break;
				if (i === 100) {
					console.error(`e2e: pids ${pids.join(' ')} survive SIGKILL; deleting the namespaces anyway`);
					break;
				}
				for (const p of pids) {
					try {
						process.kill(p, 'SIGKILL');
					} catch {}
				}
				await sleep(100);
			}
			for (const n of namespaces) spawnSync('ip', ['netns', 'del', n], { stdio: 'ignore' });
			await rm(tmp, { recursive: true, force: true });
		})());
	// The inner process ends on its pass/fail line; if it died or was stopped
	// first, the tally it kept says how far it got, and the run still ends on
	// one (once).
	let summed = false;
	const sumUp = (tally) => {
		if (summed || tally.final) return;
		summed = true;
		console.log(`e2e: ${tally.passed} passed, ${tally.failed + 1} failed`);
	};
	let signalled = false;
	const onSignal = async (sig) => {
		if (signalled) return; // a second ^C must not cut the cleanup short
		signalled = true;
		console.error(`e2e: ${sig}, cleaning up`);
		const tally = readTally(tmp);
		await cleanup();
		sumUp(tally);
		process.exit(1);
	};
	for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP']) process.on(sig, onSignal);

	try {
		for (const n of namespaces) {
			const mk = spawnSync('ip', ['netns', 'add', n], { encoding: 'utf8' });
			if (mk.status !== 0) throw new Error(`ip netns add ${n}: ${(mk.stderr ?? '').trim()}`);
			const lo = spawnSync('ip', ['-n', n, 'link', 'set', 'lo', 'up'], { encoding: 'utf8' });
			if (lo.status !== 0) throw new Error(`ip -n ${n} link set lo up: ${(lo.stderr ?? '').trim()}`);
		}
	} catch (e) {
		console.error(`e2e: ${e.message}`);
		console.log('e2e: 0 passed, 1 failed');
		await cleanup();
		return 1;
	}
	try {
		child = spawn('ip', ['netns', 'exec', ns, process.execPath, fileURLToPath(import.meta.url), '--inside', bin, guest], {
			stdio: 'inherit',
			// Chromium's profile (playwright makes one per launch) lands in our temp dir.
			env: { ...process.env, TMPDIR: tmp, E2E_TMP: tmp, E2E_NS: ns, E2E_BROWSER_NS: bns }
		});
		const timer = setTimeout(() => {
			console.error(`e2e: gave up after ${OVERALL_MS / 1000} s`);
			child.kill('SIGKILL');
		}, OVERALL_MS);
		const code = await new Promise((r) => {
			child.on('error', (e) => {
				console.error(`e2e: ${e.message}`);
				r(1);
			});
			child.on('exit', (c) => r(c ?? 1));
		});
		clearTimeout(timer);
		const tally = readTally(tmp);
		if (!signalled) sumUp(tally);
		return tally.final ? code : 1;
	} finally {
		await cleanup();
	}
}

function readTally(tmp) {
	try {
		return JSON.parse(readFileSync(join(tmp, 'tally.json'), 'utf8'));
	} catch {
		return { passed: 0, failed: 0, final: false };
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
	const browserNs = process.env.E2E_BROWSER_NS;
	const results = [];
	const tally = (final = false) =>
		writeFileSync(
			join(tmp, 'tally.json'),
			JSON.stringify({ passed: results.filter((r) => r.ok).length, failed: results.filter((r) => !r.ok).length, final })
		);
	const check = async (name, fn) => {
		const t = Date.now();
		try {
			await fn();
			results.push({ name, ok: true });
			log(`PASS ${name} (${((Date.now() - t) / 1000).toFixed(1)} s)`);
			return true;
		} catch (e) {
			results.push({ name, ok: false });
			log(`FAIL ${name}: ${e?.message?.split('\n').slice(0, 10).join('\n    ') ?? e}`);
			return false;
		} finally {
			tally();
		}
	};
	const fail = (name, why) => {
		results.push({ name, ok: false });
		log(`FAIL ${name}: ${why}`);
		tally();
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
			'--delete-grace', '5s',
			// Short, so the stuck host check (8) need not wait minutes.
			'--upgrade-stuck-after', '3s',
			// The slow image server is on this loopback, which image downloads
			// may not reach unless allowed.
			'--image-allow', '127.0.0.1/32'
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
	let relay;
	let failed = false;
	try {
		const token = await waitForDev(dataDir, () => devExited);
		log('eitri dev is up');
		relay = await startRelay(tmp, browserNs);
		log(`console relayed into namespace ${browserNs}`);

		browser = await chromium.launch({
			executablePath: await chromiumIn(tmp, browserNs),
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
		const consoleErrors = [];
		page.on('console', (m) => {
			if (m.type() !== 'error') return;
			consoleErrors.push(m.text());
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

		// 1. A signed-out visit, then log in.
		await check('a signed-out visit to the login page logs no error in the browser console', async () => {
			await page.goto(BASE + '/login');
			// The form shows once the console has had /auth/me's answer; the
			// browser logs a failed load as the response arrives, before that.
			// A round trip to the page then brings every message it logged so far.
			await page.getByLabel('Access token').waitFor();
			await page.evaluate(() => document.readyState);
			await shot('login');
			if (consoleErrors.length) throw new Error(`console errors: ${JSON.stringify(consoleErrors)}`);
		}).then(async (ok) => ok || (await failShot('signed-out'), false));
		const loggedIn = await check('log in with the admin token; the local host is connected with capacity bars', async () => {
			if (new URL(page.url()).pathname !== '/login') await page.goto(BASE + '/login');
			await page.getByLabel('Access token').fill(token);
			await page.getByRole('button', { name: 'Sign in' }).click();
			await page.waitForURL(BASE + '/', { timeout: 15_000 });
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
			// eitri dev lists its test guest in the catalogue, chosen first;
			// this VM takes the image server that narrates, by URL.
			await page.getByRole('radiogroup', { name: 'Images' }).getByRole('radio', { name: /^test-guest\b/ }).waitFor();
			await shot('create-vm-catalogue');
			await page.getByRole('radio', { name: /^By URL\b/ }).check();
			await page.getByRole('button', { name: 'Use the built-in test image' }).waitFor();
			await shot('create-vm');
			await page.getByLabel('Name', { exact: true }).fill('ui-1');
			await page.getByLabel('Image URL').fill(image.url);
			await page.getByLabel('SHA-256').fill(image.sha256);
			await page.getByRole('group', { name: 'Size presets' }).getByRole('button').first().click();
			// A marker that a reload would wipe: everything below must be pushed.
			await page.evaluate(() => (window.__e2eNoReload = true));
			await page.getByRole('button', { name: 'Create VM' }).click();
			// The form is at /vms/new: wait for the VM's own page.
			await page.waitForURL(/\/vms\/(?!new$)[^/]+$/, { timeout: 15_000 });
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
			// A count above zero: the host also says "0.0/72.0 MiB" as the answer
			// arrives, before the first step the image server holds at.
			const progressRe = /downloading image (?!0(\.0)?\/)\d+(\.\d+)?\/72(\.0)? MiB/;
			// The image server holds the download past the first progress step
			// until the page has shown that step, so how fast the host, the
			// server and the page are cannot decide whether it is seen.
			try {
				await status.getByText(/downloading image/).waitFor({ timeout: 60_000 });
				await waitFor(
					async () => (await page.evaluate(() => window.__e2eStatus)).some((t) => progressRe.test(t)),
					60_000,
					'the page shows a "downloading image N/72 MiB" progress line'
				);
				// The bar is drawn from the numbers the host reports beside it.
				await page.locator('[role="progressbar"]').first().waitFor({ timeout: 30_000 });
				await shot('vm-detail-downloading');
			} finally {
				image.release();
			}
			await factsValue(page, 'Address').getByText(/^10\.81\.0\.\d+$/).waitFor({ timeout: 180_000 });
			// The address is shown while the guest finishes booting ("waiting for
			// cloud-init"); ready follows when the guest phones home, and the page
			// says which signal made it ready.
			let word = '';
			await waitFor(
				async () => {
					word = (await status.textContent())?.trim().replace(/\s+/g, ' ') ?? '';
					return /^ready \(ready by cloud-init\)$/.test(word);
				},
				120_000,
				'the status reads "ready (ready by cloud-init)" alone, no narration left'
			).catch((err) => {
				throw new Error(`${err.message}; status is "${word}"`);
			});
			if (!(await page.evaluate(() => window.__e2eNoReload === true))) throw new Error('the page reloaded');
			const seen = await page.evaluate(() => window.__e2eStatus);
			log(`status lines seen: ${seen.map((t) => JSON.stringify(t)).join(' → ')}`);
			vmReady = true;
			log(`ready at ${(await factsValue(page, 'Address').locator('.mono').textContent())?.trim()}`);
			await shot('vm-detail');
		}).then(async (ok) => ok || (await failShot('create-vm'), false));

		// 2b. The serial console panel shows what the guest printed, live,
		// under the console's CSP (errors would be logged above), and types.
		if (!vmReady) fail('the serial console shows the guest and takes keys', 'no ready VM');
		else
			await check('the serial console shows the guest\'s ready line and echoes what is typed', async () => {
				const term = page.locator('div[aria-label="Serial console"]');
				// xterm draws only while the terminal is on screen, and the
				// usage charts put it below the fold: scroll to it, as a person would.
				await term.scrollIntoViewIfNeeded();
				await term
					.getByText(/EITRI-GUEST-READY/)
					.first()
					.waitFor({ timeout: 60_000 })
					.catch(async (err) => {
						// What the panel said and held, and the console streams the
						// page opened: enough to tell a stream that never came from
						// one that came empty from a terminal that did not draw.
						const bar = await page.locator('section[aria-labelledby="con-h"] .bar').textContent().catch(() => '?');
						const rows = await term.locator('.xterm-rows').textContent().catch(() => '?');
						const streams = requests
							.filter((q) => q.path.endsWith('/StreamConsole'))
							.map((q) => `${new Date(q.t).toISOString().slice(11, 23)}${q.done ? ' ended' : ' open'}`);
						throw new Error(
							`${err.message}\npanel: ${JSON.stringify(bar?.replace(/\s+/g, ' ').trim())}\nterminal rows: ${JSON.stringify(rows)}\nStreamConsole requests: ${streams.join(', ')}`
						);
					});
				await term.locator('.xterm-screen').click();
				await page.keyboard.type('typed-in-e2e');
				await page.keyboard.press('Enter');
				await term.getByText(/typed-in-e2e/).first().waitFor({ timeout: 30_000 });
				await shot('vm-console');
			}).then(async (ok) => ok || (await failShot('vm-console'), false));

		// 2c. The VM page charts what the host measured, live: the captions
		// say the numbers the usage stream sent and the canvases draw them.
		if (!vmReady) fail('the VM page charts its usage', 'no ready VM');
		else
			await check('the VM page charts the usage its host measured, without reloading: captions match the stream, canvases are drawn', async () => {
				const usage = page.locator('section[aria-labelledby="use-h"]');
				const cpu = usage.locator('[data-line="of one CPU"]');
				// Samples come every 10 s; a CPU rate needs two of them.
				await waitFor(
					async () => /\d\.\d%/.test((await cpu.textContent({ timeout: 1000 }).catch(() => '')) ?? ''),
					90_000,
					'the CPU chart caption shows a percentage'
				);
				const caption = ((await usage.locator('[data-line="resident"]').textContent()) ?? '').trim();
				const win = await usageWindow(vmId, token);
				const rss = win.map((s) => formatBytes(Number(s.memory_rss_bytes ?? s.memoryRssBytes)));
				// The newest sample, or the one before it if another arrived meanwhile.
				if (!rss.slice(-2).some((r) => caption.endsWith(r)))
					throw new Error(`memory caption ${JSON.stringify(caption)}, the stream's last samples ${JSON.stringify(rss.slice(-2))}`);
				const points = Number(await usage.locator('.plot').first().getAttribute('data-points'));
				if (points < win.length - 1 || points > win.length + 1) throw new Error(`the chart holds ${points} points, the stream sent ${win.length}`);
				const painted = await usage
					.locator('canvas')
					.first()
					.evaluate((c) => {
						const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
						let n = 0;
						for (let i = 3; i < d.length; i += 4) if (d[i]) n++;
						return n;
					});
				if (painted === 0) throw new Error('the CPU chart canvas is blank');
				if (!(await page.evaluate(() => window.__e2eNoReload === true))) throw new Error('the page reloaded');
				await shot('vm-usage');
			}).then(async (ok) => ok || (await failShot('vm-usage'), false));

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
				const summaryRe = /(\d+) open · (\d+) refused, (\d+) dropped(?: · (\S+ \S+) in, (\S+ \S+) out)? since agent start/;
				const traffic = row.locator('td[data-label="Traffic"]');
				const before = ((await traffic.textContent()) ?? '').trim();
				log(`exposure on 127.0.0.1:${port}, summary before: ${JSON.stringify(before)}`);
				// Three short HTTP requests, counting every byte each way, and
				// one connection held open.
				let sent = 0;
				let received = 0;
				for (let i = 0; i < 3; i++) {
					const r = await rawGet(port);
					if (!/hostname=ui-1/.test(r.text)) throw new Error(`guest answered ${JSON.stringify(r.text.slice(0, 80))}, want hostname=ui-1`);
					sent += r.sent;
					received += r.received;
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
				// Closed, and the bytes are exactly what went each way. Bytes
				// alone make no report: they come with the host's next one
				// (at the latest its 5 s heartbeat).
				const want = [formatBytes(sent), formatBytes(received)];
				let last = '';
				await waitFor(
					async () => {
						last = ((await traffic.textContent()) ?? '').trim();
						const m = last.match(summaryRe);
						return m?.[1] === '0' && m[4] === want[0] && m[5] === want[1];
					},
					20_000,
					`the summary goes back to 0 open and says ${want[0]} in, ${want[1]} out`
				).catch((err) => {
					throw new Error(`${err.message}; it says ${JSON.stringify(last)}`);
				});
				log(`summary after close: ${last}`);
				if (!(await page.evaluate(() => window.__e2eNoReload === true))) throw new Error('the page reloaded');
			}).then(async (ok) => ok || (await failShot('exposure'), false));

		// 2c. A VM from the catalogue, by name: the form raises nothing the
		// image does not need, the page names the image and its version.
		await check('create a VM by picking test-guest from the catalogue; its page shows "test-guest version 1" and it becomes ready', async () => {
			await page.goto(BASE + '/vms/new');
			await page.getByRole('heading', { name: 'New VM', level: 1 }).waitFor();
			const pick = page.getByRole('radiogroup', { name: 'Images' }).getByRole('radio', { name: /^test-guest\b/ });
			await pick.check();
			if (await page.getByLabel('Image URL').count()) throw new Error('the URL fields are shown with a catalogue image chosen');
			await page.getByLabel('Name', { exact: true }).fill('ui-2');
			await page.getByRole('group', { name: 'Size presets' }).getByRole('button').first().click();
			await page.getByRole('button', { name: 'Create VM' }).click();
			await page.waitForURL(/\/vms\/[^/]+$/, { timeout: 15_000 });
			await page.getByRole('heading', { name: 'ui-2', level: 1 }).waitFor();
			await factsValue(page, 'Image').getByText('test-guest', { exact: true }).waitFor();
			await factsValue(page, 'Image').getByText('version 1', { exact: true }).waitFor();
			await factsValue(page, 'Status').getByText(/^ready/).waitFor({ timeout: 180_000 });
			await shot('vm-detail-by-name');
		}).then(async (ok) => ok || (await failShot('create-by-name'), false));

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
			const loaded = Date.now();
			await page.goto(BASE + '/');
			await page.locator('table.vms tbody tr').first().waitFor();
			await page.getByText('live', { exact: true }).waitFor();
			// Settled: both watch streams of this page are open and every other
			// request it made has finished, with nothing new for a second.
			// (Waiting on the page's own work, not on a guess of how long it takes.)
			const isApi = (r) => r.path.startsWith('/eitri.v1.') || r.path.startsWith('/auth/');
			const isWatch = (r) => /\/Watch[A-Za-z]+$/.test(r.path);
			await waitFor(
				async () => {
					const mine = requests.filter((r) => r.t >= loaded);
					const open = mine.filter((r) => isWatch(r) && !r.done).map((r) => r.path);
					return (
						open.some((p) => p.endsWith('/WatchVMs')) &&
						open.some((p) => p.endsWith('/WatchHosts')) &&
						mine.every((r) => isWatch(r) || r.done) &&
						mine.every((r) => Date.now() - r.t >= 1000)
					);
				},
				20_000,
				'the fleet page has settled (its watch streams open, every other request finished)'
			);
			await shot('fleet');
			const from = Date.now();
			await sleep(10_000);
			const during = requests.filter((r) => r.t >= from);
			const api = during.filter(isApi);
			const watches = requests.filter((r) => r.t >= loaded && r.t < from && isWatch(r) && !r.done);
			log(`idle: ${during.length} requests in 10 s; ${watches.length} watch streams open (${[...new Set(watches.map((w) => w.path.split('/').pop()))].join(', ')})`);
			if (api.length) {
				const counts = {};
				for (const r of api) counts[r.path] = (counts[r.path] ?? 0) + 1;
				throw new Error(`API requests while idle: ${JSON.stringify(counts)}`);
			}
			if (!watches.some((w) => w.path.endsWith('/WatchVMs')) || !watches.some((w) => w.path.endsWith('/WatchHosts')))
				throw new Error('the fleet page has no open WatchVMs/WatchHosts stream');
		}).then(async (ok) => ok || (await failShot('idle'), false));

		// 6. A user CA rotation leaves the VM made before it trusting only the
		// key rotated out: its page says so and what fixes it.
		if (!vmReady) fail('a VM made before a user CA rotation is flagged stale with its fix', 'no ready VM');
		else
			await check('a VM made before a user CA rotation is flagged stale on its page, with what fixes it', async () => {
				const errorsBefore = consoleErrors.length;
				const trusts = factsValue(page, 'Trusts user CAs');
				await page.goto(`${BASE}/vms/${vmId}`);
				await trusts.getByText('current', { exact: true }).waitFor();
				if (await page.locator('[data-trust-stale]').count()) throw new Error('stale before any rotation');
				const rot = spawnSync(bin, ['ssh-ca', 'rotate', 'user'], {
					encoding: 'utf8',
					timeout: 30_000,
					env: { ...process.env, EITRI_URL: BASE, EITRI_TOKEN: token, HOME: tmp }
				});
				if (rot.status !== 0) throw new Error(`eitri ssh-ca rotate user: ${rot.status} ${rot.stderr}`);
				await page.goto(`${BASE}/vms/${vmId}`);
				await trusts.getByText('rotated out', { exact: true }).waitFor();
				const alert = trusts.locator('[data-trust-stale]');
				await alert.waitFor();
				const say = ((await alert.textContent()) ?? '').trim();
				for (const want of ['stale SSH trust', 'recreate the VM', '/etc/ssh/eitri_user_ca.pub'])
					if (!say.includes(want)) throw new Error(`the stale warning says ${JSON.stringify(say)}, without ${JSON.stringify(want)}`);
				if ((await alert.getAttribute('role')) !== 'alert') throw new Error('the stale warning is not an alert');
				await shot('vm-detail-trust-stale');
				const errors = consoleErrors.slice(errorsBefore);
				if (errors.length) throw new Error(`console errors: ${JSON.stringify(errors)}`);
			}).then(async (ok) => ok || (await failShot('trust-stale'), false));

		// The CLI as the admin, for what the checks below set up.
		const cli = (...args) => {
			const r = spawnSync(bin, args, {
				encoding: 'utf8',
				timeout: 30_000,
				env: { ...process.env, EITRI_URL: BASE, EITRI_TOKEN: token, HOME: tmp }
			});
			if (r.status !== 0) throw new Error(`eitri ${args.join(' ')}: ${r.status} ${r.stderr}`);
			return r.stdout;
		};

		// 7. An agent rollout, watched live on the hosts page. The build is a
		// script signed with dev's own release key that says another version:
		// the agent fetches and verifies it, then refuses it when it runs it
		// ("version"), before anything is swapped — so the binary this run is
		// from is never replaced (checked below).
		await check('a rollout of a build the agent refuses shows on the hosts page, live: the canary and its failure', async () => {
			const errorsBefore = consoleErrors.length;
			const binSum = () => createHash('sha256').update(readFileSync(bin)).digest('hex');
			const before = binSum();
			const version = 'v9.9.9-e2e';
			const build = join(tmp, 'fake-agent');
			await writeFile(build, '#!/bin/sh\necho "eitri version v0.0.0-not-it"\n', { mode: 0o755 });
			cli('release', 'sign', build, '--key', join(dataDir, 'control', 'release.key'), '--version', version, '--os', 'linux', '--arch', 'amd64');
			cli('release', 'upload', build);
			await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Hosts' }).click();
			await page.getByRole('heading', { name: 'Hosts', level: 1 }).waitFor();
			await page.evaluate(() => (window.__e2eNoReload = true));
			cli('host', 'upgrade', '--to', version, '--all', '--allow-downgrade');
			const panel = page.locator('section[aria-labelledby="rollout-h"]');
			await panel.getByRole('status').getByText(`Upgrading to ${version}`).waitFor({ timeout: 30_000 });
			await panel.locator('li[data-rollout-host]').first().getByText('(canary)').waitFor();
			const note = page.locator('main tbody tr').first().locator('[data-upgrade]');
			await waitFor(
				async () => /failed/.test((await note.textContent({ timeout: 1000 })) ?? ''),
				120_000,
				'the host row says its upgrade failed'
			);
			const said = ((await note.textContent()) ?? '').trim();
			if (!said.includes(`upgrade to ${version} failed`) || !said.includes('v0.0.0-not-it'))
				throw new Error(`the host row says ${JSON.stringify(said)}, want the failure and what the build said`);
			log(`host row: ${JSON.stringify(said)}; rollout: ${JSON.stringify(((await panel.textContent()) ?? '').trim().replace(/\s+/g, ' '))}`);
			await shot('hosts-rollout-failed');
			if (!(await page.evaluate(() => window.__e2eNoReload === true))) throw new Error('the page reloaded');
			if (binSum() !== before) throw new Error(`${bin} changed under the run`);
			const errors = consoleErrors.slice(errorsBefore);
			if (errors.length) throw new Error(`console errors: ${JSON.stringify(errors)}`);
		}).then(async (ok) => ok || (await failShot('rollout'), false));

		// 8. A host offered a build and still on its old version past the
		// bound shows stuck, live, on the hosts page and in the fleet's host
		// rows. This build's version check hangs (a child holds its output),
		// so the agent sits on the offer until its probe gives up (30 s);
		// dev runs with --upgrade-stuck-after 3s.
		await check('a host that stays on its old version past the bound after an offer shows stuck, on the hosts and fleet pages, live', async () => {
			const errorsBefore = consoleErrors.length;
			const version = 'v9.9.10-e2e';
			const build = join(tmp, 'hanging-agent');
			await writeFile(build, '#!/bin/sh\nsleep 600\n', { mode: 0o755 });
			cli('release', 'sign', build, '--key', join(dataDir, 'control', 'release.key'), '--version', version, '--os', 'linux', '--arch', 'amd64');
			cli('release', 'upload', build);
			cli('host', 'upgrade', 'abort'); // the halted rollout above
			if (!/\/hosts$/.test(new URL(page.url()).pathname)) {
				await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Hosts' }).click();
				await page.getByRole('heading', { name: 'Hosts', level: 1 }).waitFor();
			}
			await page.evaluate(() => (window.__e2eNoReload = true));
			cli('host', 'upgrade', '--to', version, '--all', '--allow-downgrade');
			const stuckRe = new RegExp(`^stuck: offered ${version.replace(/\./g, '\\.')} \\d+ (s|min|h|days) ago, still on \\S+`);
			const stuck = page.locator('main tbody tr').first().locator('[data-condition="upgrade_stuck"]');
			await stuck.waitFor({ timeout: 25_000 });
			const said = ((await stuck.textContent()) ?? '').trim();
			if (!stuckRe.test(said)) throw new Error(`the hosts page says ${JSON.stringify(said)}, want ${stuckRe}`);
			log(`hosts page: ${JSON.stringify(said)}`);
			await shot('hosts-stuck');
			await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Fleet' }).click();
			const row = page.locator('section[aria-labelledby="hosts-h"] tbody tr').first().locator('[data-condition="upgrade_stuck"]');
			await row.waitFor({ timeout: 10_000 });
			const inFleet = ((await row.textContent()) ?? '').trim();
			if (!stuckRe.test(inFleet)) throw new Error(`the fleet's host row says ${JSON.stringify(inFleet)}, want ${stuckRe}`);
			// Ending the rollout ends the offer: the row stops saying stuck,
			// with no reload.
			cli('host', 'upgrade', 'abort');
			await row.waitFor({ state: 'detached', timeout: 15_000 });
			if (!(await page.evaluate(() => window.__e2eNoReload === true))) throw new Error('the page reloaded');
			const errors = consoleErrors.slice(errorsBefore);
			if (errors.length) throw new Error(`console errors: ${JSON.stringify(errors)}`);
		}).then(async (ok) => ok || (await failShot('stuck'), false));
	} catch (e) {
		failed = true;
		log(`aborted: ${e?.message ?? e}`);
	} finally {
		await browser?.close().catch(() => {});
		relay?.stop();
		image.close();
		await stopDev(dev);
		await new Promise((r) => devOut.end(r));
	}
	if (failed) results.push({ name: 'aborted', ok: false });
	const failures = results.filter((r) => !r.ok).length;
	if (failures) {
		await copyFile(devLog, join(ARTIFACTS, 'dev.log')).catch(() => {});
		log(`dev log copied to ${join(ARTIFACTS, 'dev.log')}`);
		// The guests' consoles say why one never came up.
		for (const f of await findFiles(dataDir, 'serial.log')) {
			const to = join(ARTIFACTS, `serial-${basename(dirname(f))}.log`);
			await copyFile(f, to).catch(() => {});
			log(`guest serial log copied to ${to}`);
		}
	}
	log(`screenshots in ${ARTIFACTS}`);
	tally(true);
	console.log(`e2e: ${results.filter((r) => r.ok).length} passed, ${failures} failed`);
	return failures ? 1 : 0;
}

async function findFiles(dir, name) {
	const entries = await readdir(dir, { recursive: true, withFileTypes: true }).catch(() => []);
	return entries.filter((e) => e.isFile() && e.name === name).map((e) => join(e.parentPath ?? e.path, e.name));
}

// The browser namespace has only its loopback, so the console's port is
// relayed into it: socat in the dev namespace listens on a unix socket in the
// temp dir and connects each caller to the console on the dev loopback; socat
// in the browser namespace listens on the same address there (127.0.0.1:18090)
// and connects each caller to that socket. A unix socket is a file, and files
// do not care about network namespaces. The URL, its origin and its cookies are
// the same as without the relay.
//
// The console is the only thing the browser talks to: the image URL is typed
// into a form and fetched by the agent (dev namespace), and the published port
// is exercised by this process (dev namespace), so nothing else is relayed.
async function startRelay(tmp, browserNs) {
	const sock = join(tmp, 'console.sock');
	if (Buffer.byteLength(sock) > 100) throw new Error(`relay socket path ${sock} is too long for a unix socket`);
	const [host, port] = LISTEN.split(':');
	const procs = [];
	const start = (argv, what) => {
		// Own process group, so stop() takes socat's forked children with it.
		const p = spawn(argv[0], argv.slice(1), { stdio: ['ignore', 'ignore', 'pipe'], detached: true });
		let err = '';
		p.stderr.on('data', (d) => (err += d));
		p.on('exit', (c, s) => (p.died = `${what} exited (${s ?? c}) ${err.trim()}`));
		p.on('error', (e) => (p.died = `${what}: ${e.message}`));
		procs.push(p);
		return p;
	};
	const stop = () => {
		for (const p of procs) {
			try {
				process.kill(-p.pid, 'SIGKILL');
			} catch {}
		}
	};
	try {
		const devSide = start(['socat', `UNIX-LISTEN:${sock},fork,mode=600`, `TCP:${LISTEN}`], 'socat (dev side)');
		await until(() => existsSync(sock), () => devSide.died, 10_000, 'the relay socket exists');
		const browserSide = start(
			['ip', 'netns', 'exec', browserNs, 'socat', `TCP-LISTEN:${port},bind=${host},fork,reuseaddr`, `UNIX-CONNECT:${sock}`],
			'socat (browser side)'
		);
		// Ready when the console answers through both ends, asked from the
		// browser namespace itself.
		const probe =
			`fetch(${JSON.stringify(BASE + '/healthz')})` + '.then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))';
		await until(
			async () => (await inNamespace(browserNs, probe)) === 0,
			() => browserSide.died || devSide.died,
			20_000,
			`${BASE}/healthz answers in namespace ${browserNs}`
		);
	} catch (e) {
		stop();
		throw e;
	}
	return { stop };
}

// Polls ok() until it holds; fails at once when dead() names a reason.
async function until(ok, dead, ms, what) {
	const end = Date.now() + ms;
	for (;;) {
		const why = dead();
		if (why) throw new Error(why);
		if (await ok()) return;
		if (Date.now() > end) throw new Error(`timed out after ${ms / 1000} s waiting until ${what}`);
		await sleep(100);
	}
}

// Runs a snippet of JS with this node in another network namespace; resolves
// to its exit code.
function inNamespace(netns, js) {
	return new Promise((r) => {
		const p = spawn('ip', ['netns', 'exec', netns, process.execPath, '-e', js], { stdio: 'ignore' });
		const t = setTimeout(() => p.kill('SIGKILL'), 5_000);
		p.on('error', () => r(-1));
		p.on('exit', (c) => {
			clearTimeout(t);
			r(c ?? -1);
		});
	});
}

// Playwright starts the browser itself, from a path, and talks to it over
// inherited pipes (fds 3 and 4). This wrapper enters the browser namespace and
// execs Chromium in place: same pid, same fds, same arguments.
async function chromiumIn(tmp, browserNs) {
	const path = join(tmp, 'chromium-in-netns');
	await writeFile(path, `#!/bin/sh\nexec ip netns exec '${browserNs}' '${CHROMIUM}' "$@"\n`, { mode: 0o755 });
	return path;
}

// The value cell (<dd>) after a <dt> in the VM detail's facts list.
function factsValue(page, term) {
	return page.locator('dl.facts dt').filter({ hasText: new RegExp(`^${term}$`) }).locator('xpath=following-sibling::dd[1]');
}

// usageWindow reads the first message of a VM's usage stream (its window)
// straight from the API, as Connect's JSON streaming protocol frames it.
async function usageWindow(vmId, token) {
	const body = Buffer.from(JSON.stringify({ vmId }));
	const frame = Buffer.alloc(5 + body.length);
	frame.writeUInt32BE(body.length, 1);
	body.copy(frame, 5);
	const ac = new AbortController();
	try {
		const res = await fetch(BASE + '/eitri.v1.UsageService/WatchUsage', {
			method: 'POST',
			headers: { 'Content-Type': 'application/connect+json', Authorization: `Bearer ${token}` },
			body: frame,
			signal: ac.signal
		});
		const reader = res.body.getReader();
		let buf = Buffer.alloc(0);
		while (buf.length < 5 || buf.length < 5 + buf.readUInt32BE(1)) {
			const { value, done } = await reader.read();
			if (done) throw new Error(`the usage stream ended: ${buf.toString()}`);
			buf = Buffer.concat([buf, Buffer.from(value)]);
		}
		const msg = JSON.parse(buf.subarray(5, 5 + buf.readUInt32BE(1)).toString());
		if (!msg.window) throw new Error(`the usage stream began with ${JSON.stringify(msg)}`);
		return msg.window.vms ?? [];
	} finally {
		ac.abort();
	}
}

// formatBytes is the console's (frontend/src/lib/display.ts).
function formatBytes(v) {
	const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
	if (!Number.isFinite(v) || v < 0) return '—';
	let i = 0;
	while (v >= 1024 && i < units.length - 1) {
		v /= 1024;
		i++;
	}
	if (i === 0) return `${v} B`;
	const text = v < 10 ? v.toFixed(1).replace(/\.0$/, '') : Math.round(v).toString();
	if (text === '1024' && i < units.length - 1) return `1 ${units[i + 1]}`;
	return `${text} ${units[i]}`;
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
// has time to narrate the download. Past HOLD_AT bytes (beyond the host's
// first 32 MiB progress step) it holds until release(): the host has then
// reported that step and stays on it however long the test takes to look. While
// held it sends HOLD_TRICKLE bytes a second: enough for the host's stall rule
// (1 MiB in every 60 s), and the next progress step (64 MiB) is over seven
// minutes away, far past the test's own 60 s wait for the progress line.
async function slowImageServer(raw) {
	let release;
	const released = new Promise((r) => (release = r));
	let isReleased = false;
	released.then(() => (isReleased = true));
	const size = statSync(raw).size;
	if (size > IMAGE_SIZE) throw new Error(`${raw} is larger than ${IMAGE_SIZE} bytes`);
	const data = Buffer.alloc(IMAGE_SIZE);
	(await readFile(raw)).copy(data);
	const sha256 = createHash('sha256').update(data).digest('hex');
	const server = http.createServer(async (req, res) => {
		if (req.url !== '/guest.raw') {
			res.writeHead(404).end();
			return;
		}
		res.writeHead(200, { 'content-type': 'application/octet-stream', 'content-length': String(data.length) });
		for (let off = 0; off < data.length && !res.destroyed; ) {
			if (off >= HOLD_AT && !isReleased) {
				if (off === HOLD_AT) log(`image download held at ${HOLD_AT >> 20} MiB until the page has shown the progress`);
				res.write(data.subarray(off, off + HOLD_TRICKLE));
				off += HOLD_TRICKLE;
				await Promise.race([released, sleep(1000)]);
				continue;
			}
			const next = Math.min(off + CHUNK, data.length);
			res.write(data.subarray(off, next));
			off = next;
			await sleep(CHUNK_EVERY_MS);
		}
		res.end();
	});
	await new Promise((r) => server.listen(0, '127.0.0.1', r));
	return {
		url: `http://127.0.0.1:${server.address().port}/guest.raw`,
		sha256,
		release,
		close: () => {
			release();
			server.close();
			server.closeAllConnections?.();
		}
	};
}

// One GET on a connection of its own that is closed once the answer is in:
// no pooled keep-alive connection outlives it to count as an open session.
// rawGet asks the guest's web server for / over a plain socket and counts
// the bytes each way, as the published port should.
function rawGet(port) {
	return new Promise((res, rej) => {
		const req = 'GET / HTTP/1.0\r\nHost: e2e\r\n\r\n';
		const chunks = [];
		const s = net.connect(port, '127.0.0.1', () => s.write(req));
		s.setTimeout(10_000, () => s.destroy(new Error(`port ${port}: no answer in 10 s`)));
		s.on('data', (d) => chunks.push(d));
		s.on('error', rej);
		s.on('close', (hadError) => {
			if (hadError) return;
			const body = Buffer.concat(chunks);
			res({ sent: Buffer.byteLength(req), received: body.length, text: body.toString('utf8') });
		});
	});
}

function openSocket(port) {
	return new Promise((res, rej) => {
		const s = net.connect(port, '127.0.0.1', () => res(s));
		s.on('error', rej);
		s.setTimeout(60_000, () => s.destroy());
	});
}
