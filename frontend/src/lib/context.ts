import { getContext, setContext } from 'svelte';
import { createClient, type Client, type Transport } from '@connectrpc/connect';
import { createConnectTransport } from '@connectrpc/connect-web';
import { VMService } from '@eitri/sdk/vm_pb';
import { ExposureService } from '@eitri/sdk/exposure_pb';
import { HostService } from '@eitri/sdk/host_pb';
import { TokenService } from '@eitri/sdk/token_pb';
import { ReleaseService } from '@eitri/sdk/release_pb';
import { ImageService } from '@eitri/sdk/images_pb';
import { UsageService } from '@eitri/sdk/usage_pb';
import { LinkBoard, Session } from './live.svelte';

export type Eitri = {
	transport: Transport;
	vms: Client<typeof VMService>;
	exposures: Client<typeof ExposureService>;
	hosts: Client<typeof HostService>;
	tokens: Client<typeof TokenService>;
	releases: Client<typeof ReleaseService>;
	images: Client<typeof ImageService>;
	usage: Client<typeof UsageService>;
	board: LinkBoard;
	session: Session;
};

const key = Symbol('eitri');

/** The one transport: same origin, session cookie carried by the browser. */
export function makeTransport(origin: string): Transport {
	return createConnectTransport({
		baseUrl: origin,
		useBinaryFormat: false,
		fetch: (input, init) => globalThis.fetch(input, { ...init, credentials: 'same-origin' })
	});
}

export function provideEitri(transport: Transport): Eitri {
	const e: Eitri = {
		transport,
		vms: createClient(VMService, transport),
		exposures: createClient(ExposureService, transport),
		hosts: createClient(HostService, transport),
		tokens: createClient(TokenService, transport),
		releases: createClient(ReleaseService, transport),
		images: createClient(ImageService, transport),
		usage: createClient(UsageService, transport),
		board: new LinkBoard(),
		session: new Session()
	};
	setContext(key, e);
	return e;
}

export function eitri(): Eitri {
	const e = getContext<Eitri | undefined>(key);
	if (!e) throw new Error('eitri context missing: provideEitri in the root layout');
	return e;
}
