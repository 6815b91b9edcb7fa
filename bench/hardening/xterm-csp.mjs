// xterm-csp.mjs: opens an xterm.js terminal in real Chromium under the
// console's style policy (style-src 'self'), as SerialConsole.svelte opens
// it, and checks that its styles apply (a coloured word has its colour)
// with no CSP violation; and, for contrast, that a bare open is refused.
//
//   node bench/hardening/xterm-csp.mjs     (from the repository root)
//
// Exits 1 when the terminal's styles are missing or anything is refused.
import http from 'node:http';
import { readFileSync } from 'node:fs';
import { buildSync } from 'esbuild';
import { chromium } from 'playwright-core';

const policy = "default-src 'self'; script-src 'self'; style-src 'self'; style-src-attr 'unsafe-inline'";
const files = {
	'/': ['text/html', '<!doctype html><link rel="stylesheet" href="/xterm.css"><script type="module" src="/main.js"></script><div id="box"></div>'],
	'/xterm.css': ['text/css', readFileSync('node_modules/@xterm/xterm/css/xterm.css')],
	'/xterm.mjs': ['text/javascript', readFileSync('node_modules/@xterm/xterm/lib/xterm.mjs')],
	'/cspstyles.js': ['text/javascript', buildSync({ entryPoints: ['frontend/src/lib/cspstyles.ts'], format: 'esm', write: false }).outputFiles[0].contents],
	'/main.js': ['text/javascript', `
import { Terminal } from './xterm.mjs';
import { mirrorStyles, withInertStyles } from './cspstyles.js';
const box = document.getElementById('box');
const guarded = location.search === '?guarded';
const t = new Terminal({ cols: 100, rows: 28, fontSize: 13 });
if (guarded) { mirrorStyles(box); withInertStyles(() => t.open(box)); } else t.open(box);
t.write('hello \\x1b[31mred\\x1b[0m world', () => setTimeout(() => (window.done = true), 200));`]
};
const srv = http.createServer((req, res) => {
	const f = files[new URL(req.url, 'http://x').pathname];
	if (!f) return res.writeHead(404).end();
	res.writeHead(200, { 'content-type': f[0], 'content-security-policy': policy }).end(f[1]);
});
await new Promise((r) => srv.listen(0, '127.0.0.1', r));
const base = `http://127.0.0.1:${srv.address().port}/`;
const browser = await chromium.launch({ executablePath: '/usr/bin/chromium', args: ['--no-sandbox'] });
let failed = false;
for (const mode of ['guarded', 'bare']) {
	const page = await browser.newPage();
	const refused = [];
	page.on('console', (m) => m.type() === 'error' && !/status of 404/.test(m.text()) && refused.push(m.text())); // 404: favicon
	page.on('pageerror', (e) => refused.push(e.message));
	await page.goto(base + (mode === 'guarded' ? '?guarded' : ''));
	await page.waitForFunction(() => window.done);
	const red = await page.evaluate(() => {
		const s = [...document.querySelectorAll('.xterm-rows span')].find((x) => x.textContent === 'red');
		return s ? getComputedStyle(s).color : 'missing';
	});
	console.log(`${mode}: "red" is drawn in ${red}; ${refused.length} CSP refusals`, refused[0] ?? "");
	if (mode === 'guarded' && (red !== 'rgb(204, 0, 0)' || refused.length > 0)) failed = true;
	if (mode === 'bare' && refused.length === 0) console.log('bare: nothing refused (has the policy changed?)');
}
await browser.close();
srv.close();
process.exit(failed ? 1 : 0);
