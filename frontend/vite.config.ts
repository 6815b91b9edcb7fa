import { sveltekit } from '@sveltejs/kit/vite';
import { defineConfig } from 'vitest/config';

// Node's environment, without depending on @types/node for one variable.
const env = (globalThis as { process?: { env: Record<string, string | undefined> } }).process?.env ?? {};

export default defineConfig({
	plugins: [sveltekit()],
	server: {
		// `npm run dev` against a running `eitri dev`: same-origin through the proxy.
		proxy: Object.fromEntries(
			['/eitri.v1.', '/auth/', '/guest-image.json'].map((p) => [
				p,
				{ target: env.EITRI_URL ?? 'http://127.0.0.1:8080', changeOrigin: false }
			])
		)
	},
	test: {
		include: ['src/**/*.test.ts'],
		environment: 'node'
	}
});
