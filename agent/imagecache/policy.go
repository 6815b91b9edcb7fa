package imagecache

import "github.com/a73x/eitri/wire/addrpolicy"

// AddressPolicy decides which addresses image downloads may connect to (see
// addrpolicy.Policy). The zero policy admits public unicast addresses only.
type AddressPolicy = addrpolicy.Policy

// Endpoint admits requests to one address and port under a path prefix.
type Endpoint = addrpolicy.Endpoint

// RefusedAddressError is a connection the policy did not allow.
type RefusedAddressError = addrpolicy.RefusedError
