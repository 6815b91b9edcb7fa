// Package sshcert holds what the control plane (which signs SSH user
// certificates) and the agent (whose seed tells a guest's sshd which ones to
// accept) must agree on.
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
