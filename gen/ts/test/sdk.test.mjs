// @eitri/sdk from plain node, with connect-node, against a real control
// plane: `eitri server` (its self-made TLS CA, its admin token file) and an
// `eitri agent` joined with a token minted through the SDK, so a VM can be
// placed. Unary calls and a WatchVMs stream, under the Connect protocol and
// gRPC; the stream must show a VM created through the API.
//
//   EITRI_BIN=bin/eitri npm run --workspace gen/ts test
//
// The agent makes a bridge and NAT, so everything runs in a private network
// and PID namespace (root): nothing touches the machine's network, the fixed
// loopback port cannot collide, and every process dies with the test.
import { spawn, spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { mkdtemp, readFile, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const SELF = fileURLToPath(import.meta.url);
const LISTEN = '127.0.0.1:17443';
const BASE = `https://${LISTEN}`;
// Never reached: the VM only has to be placed and listed, not to boot.
const IMAGE_URL = 'https://images.example.invalid/sdk-test.raw';
const IMAGE_SHA256 = 'ab'.repeat(32);

if (process.argv[2] === '--inside') {
	await inside();
} else {
	process.exitCode = outside();
}

function outside() {
	const skip = (why) => (console.log(`sdk test: skipped: ${why}`), 0);
	if (!process.env.EITRI_BIN) return skip('EITRI_BIN is not set (make build; EITRI_BIN=bin/eitri)');
	// npm runs this in gen/ts; a relative EITRI_BIN means where npm was run.
	const bin = resolve(process.env.INIT_CWD ?? process.cwd(), process.env.EITRI_BIN);
	if (!existsSync(bin)) {
		console.error(`sdk test: EITRI_BIN ${bin} does not exist`);
		return 1;
	}
	if (process.getuid?.() !== 0) return skip('needs root (the agent makes a bridge and NAT in a private network namespace)');
	// --kill-child: if this process dies, the inner one does, and with it
	// (PID 1 of its namespace) the server and the agent. --mount-proc, so
	// /proc shows the agent the PIDs it gets from the namespace.
	const r = spawnSync('unshare', ['--net', '--pid', '--mount', '--mount-proc', '--fork', '--kill-child', process.execPath, SELF, '--inside'], {
		stdio: 'inherit',
		env: { ...process.env, EITRI_BIN: bin },
		timeout: 10 * 60_000
	});
	if (r.error) {
		console.error(`sdk test: unshare: ${r.error.message}`);
		return 1;
	}
	return r.status ?? 1;
}

async function inside() {
	const { test, before, after } = await import('node:test');
	const assert = (await import('node:assert/strict')).default;
	const { createClient, Code, ConnectError } = await import('@connectrpc/connect');
	const { createConnectTransport, createGrpcTransport } = await import('@connectrpc/connect-node');
	const { VMService } = await import('@eitri/sdk/vm_pb');
	const { HostService } = await import('@eitri/sdk/host_pb');

	const ip = spawnSync('ip', ['link', 'set', 'lo', 'up'], { encoding: 'utf8' });
	if (ip.status !== 0) throw new Error(`ip link set lo up: ${ip.stderr}`);

	const tmp = await mkdtemp(join(tmpdir(), 'eitri-sdk-'));
	const procs = [];
	const start = (name, args) => {
		const p = spawn(process.env.EITRI_BIN, args, { stdio: ['ignore', 'ignore', 'pipe'] });
		p.log = '';
		p.stderr.on('data', (b) => (p.log += b));
		p.name = name;
		procs.push(p);
		return p;
	};
	let token, ca;
	const auth = (next) => async (req) => {
		req.header.set('Authorization', `Bearer ${token}`);
		return next(req);
	};
	const transports = () => ({
		connect: createConnectTransport({ baseUrl: BASE, httpVersion: '2', nodeOptions: { ca }, interceptors: [auth] }),
		grpc: createGrpcTransport({ baseUrl: BASE, nodeOptions: { ca }, interceptors: [auth] })
	});

	before(async () => {
		const cp = join(tmp, 'control');
		start('server', ['server', '--listen', LISTEN, '--data-dir', cp, '--public-url', BASE, '--tls-hosts', '127.0.0.1']);
		// The first start writes the admin's token (0600) and the CA that
		// signed the serving certificate.
		await until('the admin token and CA', async () => {
			token = (await readFile(join(cp, 'admin.token'), 'utf8')).trim();
			ca = await readFile(join(cp, 'tls', 'ca.crt'));
			return token !== '';
		});
		const hosts = createClient(HostService, transports().connect);
		await until('the server to answer', async () => (await hosts.listHosts({}), true));
		const { token: join_ } = await hosts.createJoinToken({});
		assert.match(join_, /\S/, 'CreateJoinToken returns a token');
		start('agent', ['agent', '--join', join_, '--data-dir', join(tmp, 'agent'), '--name', 'sdk-host', '--accel', 'tcg']);
		// Placement needs a connected host that has reported its capacity.
		let ready = false;
		for await (const ev of hosts.watchHosts({}, { signal: AbortSignal.timeout(120_000) })) {
			const list = ev.event.case === 'snapshot' ? ev.event.value.hosts : ev.event.case === 'changed' ? [ev.event.value] : [];
			if ((ready = list.some((h) => h.name === 'sdk-host' && h.connected && h.capacity !== undefined))) break;
		}
		assert.ok(ready, 'WatchHosts shows the joined agent');
	});

	after(async () => {
		for (const p of procs) {
			if (p.exitCode === null && p.signalCode === null) {
				p.kill('SIGTERM');
				await new Promise((r) => p.once('exit', r));
			}
		}
		await rm(tmp, { recursive: true, force: true });
	});

	for (const protocol of ['connect', 'grpc']) {
		test(`unary calls and a WatchVMs stream over ${protocol}`, async (t) => {
			t.after(() => {
				if (!t.passed) for (const p of procs) console.error(`--- ${p.name} log\n${p.log.slice(-4000)}`);
			});
			const vms = createClient(VMService, transports()[protocol]);
			const name = `sdk-${protocol}`;

			const err = await vms.createVM({ name: 'Not_A_Label', imageUrl: IMAGE_URL, imageSha256: IMAGE_SHA256, vcpus: 1, memMb: 64n, diskGb: 1n }).catch((e) => e);
			assert.ok(err instanceof ConnectError, `a bad name is refused (got ${err})`);
			assert.equal(err.code, Code.InvalidArgument);
			assert.match(err.rawMessage, /^name\b/, 'the error names the field');

			const anon = createClient(VMService, protocol === 'connect'
				? createConnectTransport({ baseUrl: BASE, httpVersion: '2', nodeOptions: { ca } })
				: createGrpcTransport({ baseUrl: BASE, nodeOptions: { ca } }));
			const denied = await anon.listVMs({}).catch((e) => e);
			assert.equal(ConnectError.from(denied).code, Code.Unauthenticated, 'no token, no answer');

			const abort = new AbortController();
			const stream = vms.watchVMs({}, { signal: abort.signal })[Symbol.asyncIterator]();
			try {
				const first = await stream.next();
				assert.equal(first.value?.event.case, 'snapshot', 'a watch opens with the snapshot');
				assert.ok(!first.value.event.value.vms.some((v) => v.name === name), `${name} is not there before it is created`);

				const { vm } = await vms.createVM({
					name, imageUrl: IMAGE_URL, imageSha256: IMAGE_SHA256, vcpus: 1, memMb: 64n, diskGb: 1n, powerState: 'stopped'
				});
				assert.equal(vm.name, name);
				assert.match(vm.id, /^vm-/);

				let seen;
				while (!seen) {
					const next = await stream.next();
					assert.ok(!next.done, 'the stream stays open');
					const ev = next.value.event;
					if (ev.case === 'changed' && ev.value.id === vm.id) seen = ev.value;
				}
				assert.equal(seen.name, name, 'the stream carries the created VM, whole');
				assert.equal(seen.memMb, 64n);
				assert.equal(seen.powerState, 'stopped');

				const got = await vms.getVM({ id: vm.id });
				assert.equal(got.vm?.name, name);
				const listed = await vms.listVMs({});
				assert.ok(listed.vms.some((v) => v.id === vm.id), 'ListVMs has it');

				const deleted = await vms.deleteVM({ id: vm.id });
				assert.equal(deleted.vm?.deleted, true);
				let gone;
				while (!gone) {
					const ev = (await stream.next()).value.event;
					if (ev.case === 'changed' && ev.value.id === vm.id && ev.value.deleted) gone = ev.value;
				}
				assert.ok(gone.restorableUntil, 'a deleted VM is restorable for a while');
			} finally {
				abort.abort();
				await stream.return?.();
			}
		});
	}

	// until retries fn (errors count as not yet) until it is true; the bound
	// is the whole run's, not a speed assertion.
	async function until(what, fn) {
		const deadline = Date.now() + 60_000;
		for (;;) {
			let last;
			try {
				if (await fn()) return;
			} catch (e) {
				last = e;
			}
			for (const p of procs) if (p.exitCode !== null) throw new Error(`eitri ${p.name} exited (${p.exitCode}) waiting for ${what}:\n${p.log}`);
			if (Date.now() > deadline) throw new Error(`gave up waiting for ${what}: ${last ?? 'not yet'}`);
			await new Promise((r) => setTimeout(r, 100));
		}
	}
}
