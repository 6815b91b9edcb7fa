package sshcert_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/wire/sshcert"
)

func TestAPrincipalNamesTheUserAndTheVM(t *testing.T) {
	assert.Equal(t, "eitri@vm-1", sshcert.Principal("eitri", "vm-1"))
	assert.NotEqual(t, sshcert.Principal("eitri", "vm-1"), sshcert.Principal("eitri", "vm-2"),
		"the same login user on two VMs needs two certificates")
}

func TestTheHostAliasIsWhatTheKnownHostsPatternCovers(t *testing.T) {
	assert.Equal(t, "eitri-vm-1", sshcert.HostAlias("vm-1"))
	assert.Equal(t, "eitri-*", sshcert.HostAliasPattern)
}
