// The limits the control plane puts on what a caller sends, for the forms to
// say ahead of a call (the Go side's copy is wire/bounds, which the server
// enforces on every call whatever a form allowed). Every bound is inclusive.

/** A VM's size. */
export const VMSize = {
	minVcpus: 1,
	maxVcpus: 256,
	minMemMb: 64,
	maxMemMb: 4 << 20,
	minDiskGb: 1,
	maxDiskGb: 64 << 10
} as const;

/** A DNS label's length: a VM's name becomes its guest's hostname. */
export const maxNameLen = 63;

/** The largest TCP or UDP port. */
export const maxPort = 65535;
