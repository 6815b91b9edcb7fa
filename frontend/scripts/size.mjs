// Reports the gzipped JavaScript (and CSS) a browser loads for the first
// route, "/" (Fleet): the client entries, the root layout, the page, and
// everything they import statically. Run after `npm run build`; fails when the
// JS is over the budget.
import { readFileSync, readdirSync } from 'node:fs';
import { gzipSync } from 'node:zlib';
import { join } from 'node:path';

const BUDGET = 150 * 1024;
const out = '.svelte-kit/output/client';
const manifest = JSON.parse(readFileSync(join(out, '.vite/manifest.json'), 'utf8'));
const nodesDir = '.svelte-kit/generated/client-optimized/nodes';

function nodeFor(component) {
	for (const f of readdirSync(nodesDir)) {
		const src = readFileSync(join(nodesDir, f), 'utf8');
		if (src.includes(component)) return `${nodesDir}/${f}`;
	}
	throw new Error(`no node for ${component}`);
}

const roots = [
	...Object.keys(manifest).filter((k) => manifest[k].isEntry && !manifest[k].isDynamicEntry),
	nodeFor('src/routes/+layout.svelte'),
	nodeFor('src/routes/+page.svelte')
];
const seen = new Set();
const css = new Set();
(function walk(keys) {
	for (const k of keys) {
		if (seen.has(k)) continue;
		seen.add(k);
		for (const c of manifest[k].css ?? []) css.add(c);
		walk(manifest[k].imports ?? []);
	}
})(roots);

const gz = (file) => gzipSync(readFileSync(join(out, file)), { level: 9 }).length;
let js = 0;
let raw = 0;
for (const k of seen) {
	js += gz(manifest[k].file);
	raw += readFileSync(join(out, manifest[k].file)).length;
}
let cssBytes = 0;
for (const c of css) cssBytes += gz(c);
const kb = (n) => `${(n / 1024).toFixed(1)} KiB`;
console.log(`first route (/): ${seen.size} JS files, ${kb(raw)} raw, ${kb(js)} gzipped JS, ${kb(cssBytes)} gzipped CSS`);
if (js > BUDGET) {
	console.error(`over the ${kb(BUDGET)} budget`);
	process.exit(1);
}
