import adapter from '@sveltejs/adapter-static';
import { vitePreprocess } from '@sveltejs/vite-plugin-svelte';

/** @type {import('@sveltejs/kit').Config} */
export default {
	preprocess: vitePreprocess(),
	kit: {
		// A single-page app: the Go binary serves index.html for every path it
		// does not otherwise know, and the client router takes it from there.
		adapter: adapter({ pages: 'build', assets: 'build', fallback: 'index.html', strict: true })
	},
	compilerOptions: { runes: true }
};
