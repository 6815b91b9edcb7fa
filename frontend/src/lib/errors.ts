import { Code, ConnectError } from '@connectrpc/connect';

/** An API failure in words, for the place the action was taken. The server's
 *  own message when it sent one; otherwise what the code means. */
export function errorText(e: unknown): string {
	if (e instanceof DOMException && e.name === 'AbortError') return 'cancelled';
	const ce = ConnectError.from(e);
	if (ce.rawMessage) return ce.rawMessage;
	switch (ce.code) {
		case Code.Unavailable:
			return 'the control plane cannot be reached';
		case Code.Unauthenticated:
			return 'your session has ended; sign in again';
		case Code.PermissionDenied:
			return 'you are not allowed to do that';
		case Code.DeadlineExceeded:
			return 'the control plane took too long to answer';
		default:
			return Code[ce.code] ?? 'unknown error';
	}
}
