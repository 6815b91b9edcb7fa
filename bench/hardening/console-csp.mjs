// console-csp.mjs: loads the built console in real Chromium under the control
// plane's Content-Security-Policy, signs in, walks its pages, tries to frame
// it, and prints every CSP violation, console error and page error.
//
//   make build && bin/eitri server --listen 127.0.0.1:18443 --data-dir /tmp/csp &
//   node bench/hardening/console-csp.mjs https://127.0.0.1:18443 /tmp/csp/admin.token
//
// Exits 1 if any of them, or a framing that was not refused, shows up.
import { readFileSync } from 'node:fs';
import { chromium } from 'playwright-core';

const [base, tokenFile] = process.argv.slice(2);
if (!base || !tokenFile) {
	console.error('usage: console-csp.mjs BASE_URL ADMIN_TOKEN_FILE');
	process.exit(2);
}
const token = readFileSync(tokenFile, 'utf8').trim();
const browser = await chromium.launch({ executablePath: '/usr/bin/chromium', args: ['--no-sandbox'] });
const ctx = await browser.newContext({ ignoreHTTPSErrors: true }); // the server's self-made certificate
const page = await ctx.newPage();
const problems = [];
await page.addInitScript(() => {
	document.addEventListener('securitypolicyviolation', (e) =>
		console.error(`CSP violation: ${e.violatedDirective} blocked ${e.blockedURI} ${e.sample}`));
});
page.on('console', (m) => {
	if (m.type() === 'error') problems.push(m.text());
});
page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));

const resp = await page.goto(base + '/login');
console.log('Content-Security-Policy:', resp.headers()['content-security-policy']);
await page.getByLabel('Access token').fill(token);
await page.getByRole('button', { name: 'Sign in' }).click();
await page.waitForURL((u) => !u.pathname.startsWith('/login'), { timeout: 10000 });
for (const p of ['/', '/hosts', '/tokens', '/vms/new']) {
	await page.goto(base + p);
	await page.waitForTimeout(800);
	console.log(`${p}: ${await page.title()}`);
}

const framer = await ctx.newPage();
const framing = [];
framer.on('console', (m) => framing.push(m.text()));
await framer.setContent(`<iframe src="${base}/"></iframe>`);
await framer.waitForTimeout(1500);
if (!framing.some((t) => t.includes("frame-ancestors 'none'"))) problems.push('a foreign page framed the console');
else console.log('framing refused: frame-ancestors \'none\'');

await browser.close();
if (problems.length) {
	console.error('PROBLEMS:\n' + problems.join('\n'));
	process.exit(1);
}
console.log('the console runs under its CSP: no violations, no page errors');
