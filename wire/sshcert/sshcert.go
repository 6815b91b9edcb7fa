// Package sshcert holds what the control plane (which signs SSH user and
// host certificates), the agent (whose seed tells a guest's sshd which ones
// to accept) and the CLI (which connects to guests by their alias) must
// agree on.
package sshcert

// Principal is the one principal of a user certificate for loginUser on one
// VM. It names the VM as well as the user: every eitri guest trusts the same
// user CA and most share a login user, so a principal of the user alone
// would let a certificate issued for one tenant's VM open every other
// tenant's. The guest's sshd accepts it for loginUser through
// AuthorizedPrincipalsFile, which lists exactly this string.
func Principal(loginUser, vmID string) string {
	return loginUser + "@" + vmID
}

// AliasPrefix starts every host alias. VM names may not start with it (nor
// with "vm-", the ids' prefix): a name is the tenant's choice, and a name
// shaped like another VM's alias would be a claim on its identity.
const AliasPrefix = "eitri-"

// HostAlias is the name a client connects to a VM by (ssh's HostKeyAlias),
// and a principal of the guest's host certificate.
func HostAlias(vmID string) string { return AliasPrefix + vmID }

// HostAliasPattern is the known_hosts host pattern matching every
// HostAlias and no name eitri does not give out: the @cert-authority line
// trusts the host CA for these names only, never "*".
const HostAliasPattern = AliasPrefix + "*"
