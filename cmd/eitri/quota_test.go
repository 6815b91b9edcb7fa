package main

import (
	"encoding/json"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/cmd/eitri/cli"
)

func TestQuotaGetAndSetFromTheCLI(t *testing.T) {
	eitri := cliOnServer(t)
	_, err := eitri("token", "create", "ci", "--user", "alice")
	require.NoError(t, err)
	row := func(out, limit, used, of, from string) {
		t.Helper()
		assert.Regexp(t, regexp.MustCompile(`(?m)^`+limit+`\s+`+used+`\s+`+of+`\s+`+from+`\s*$`), out)
	}

	out, err := eitri("quota", "set", "--user", "alice", "--vcpus", "8", "--streams", "2")
	require.NoError(t, err)
	assert.Contains(t, out, "quota of alice")
	row(out, "vcpus", "0", "8", "own")
	row(out, "streams", "0", "2", "own")
	row(out, "vms", "0", "20", "default")

	out, err = eitri("quota", "get", "--user", "alice", "-o", "json")
	require.NoError(t, err)
	var q struct {
		Quota struct {
			Effective map[string]string `json:"effective"`
		} `json:"quota"`
	}
	require.NoError(t, json.Unmarshal([]byte(out), &q), out)
	assert.Equal(t, "8", q.Quota.Effective["vcpus"])

	out, err = eitri("quota", "set", "--defaults", "--vms", "5")
	require.NoError(t, err)
	assert.Regexp(t, `(?m)^vms\s+5\s*$`, out)

	out, err = eitri("quota", "set", "--user", "alice", "--vcpus", "default")
	require.NoError(t, err)
	row(out, "vcpus", "0", "64", "default")
	row(out, "vms", "0", "5", "default")

	out, err = eitri("quota", "get")
	require.NoError(t, err)
	assert.Contains(t, out, "quota of admin", "no --user: your own")

	for _, bad := range [][]string{
		{"quota", "set", "--user", "alice"},
		{"quota", "set", "--user", "alice", "--vms", "-1"},
		{"quota", "set", "--user", "alice", "--vms", "lots"},
		{"quota", "frob"},
	} {
		_, err := eitri(bad...)
		var ue cli.UsageError
		assert.ErrorAs(t, err, &ue, "%v", bad)
	}
	_, err = eitri("quota", "set", "--user", "nobody", "--vms", "1")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "not found: user_name:")
}
