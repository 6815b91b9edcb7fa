// Package bounds holds the limits the control plane puts on what a caller
// sends, defined once for the fleet, which enforces them on every call, and
// for whatever publishes them ahead of a call (the MCP tools' input schemas;
// the console's copy is frontend/src/lib/bounds.ts). Every bound is
// inclusive.
package bounds

// A VM's size.
const (
	MinVCPUs  = 1
	MaxVCPUs  = 256
	MinMemMB  = 64
	MaxMemMB  = 4 << 20 // 4 TiB
	MinDiskGB = 1
	MaxDiskGB = 64 << 10 // 64 TiB
)

// Lengths of free text, in bytes. Everything a caller sends is stored, sent
// to a host and may be echoed in an error, so none of it may be as big as a
// request can be.
const (
	// MaxNameLen is a DNS label's: a VM's name becomes its guest's
	// hostname. User names share it.
	MaxNameLen = 63
	// MaxIDLen holds every id eitri mints, with room to spare.
	MaxIDLen  = 64
	MaxURLLen = 2048
	// MaxSSHKeyLen is a line of several long keys' worth.
	MaxSSHKeyLen = 8 << 10
)

// MaxPort is the largest TCP or UDP port.
const MaxPort = 65535
