package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/encoding/protojson"

	"github.com/a73x/eitri/cmd/eitri/cli"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

// The catalogue through the CLI: an admin adds an image, everyone lists it,
// and `vm create --image NAME` makes a VM of it sized at least to its
// minimums, which the VM's page shows by name and version.
func TestTheCLIKeepsTheCatalogueAndCreatesByName(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	h := e.connectHost("h1")
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "running", Phase: "ready", Ip: "10.77.0.9"}
	})
	sha := strings.Repeat("ab", 32)

	out, err := e.eitri("image", "add", "appliance", "--url", "http://images.test/a.raw", "--sha256", strings.ToUpper(sha),
		"--os", "busybox", "--arch", "amd64", "--min-disk-gb", "6", "--min-mem-mb", "768", "--readiness", "address",
		"--description", "a tiny appliance")
	require.NoError(t, err)
	assert.Regexp(t, `ready by\s+address`, out)

	_, err = e.eitri("image", "add", "x", "--url", "http://images.test/a.raw", "--sha256", sha, "--readiness", "soon")
	var ue cli.UsageError
	assert.ErrorAs(t, err, &ue, "an unknown readiness word is refused before calling")
	_, err = e.eitri("image", "add", "x", "--url", "http://images.test/a.raw")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "invalid argument: sha256:", "the server's message names the field")

	out, err = e.eitri("image", "ls")
	require.NoError(t, err)
	assert.Regexp(t, `appliance\s+1\s+busybox\s+amd64\s+768M/6G\s+address\s+—\s+ababababab`, out)
	assert.Contains(t, out, "a tiny appliance")

	// The defaults (512 MiB, 4 GiB) are raised to the image's minimums.
	out, err = e.eitri("vm", "create", "web-1", "--image", "appliance", "--wait")
	require.NoError(t, err, out)
	assert.Contains(t, out, "ready at 10.77.0.9")
	out, err = e.eitri("vm", "get", "web-1", "-o", "json")
	require.NoError(t, err)
	var got eitriv1.GetVMResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &got), out)
	assert.Equal(t, "appliance", got.Vm.ImageName)
	assert.Equal(t, int64(1), got.Vm.ImageVersion)
	assert.Equal(t, sha, got.Vm.ImageSha256)
	assert.Equal(t, int64(768), got.Vm.MemMb)
	assert.Equal(t, int64(6), got.Vm.DiskGb)
	out, err = e.eitri("vm", "get", "web-1")
	require.NoError(t, err)
	assert.Contains(t, out, "appliance version 1 (http://images.test/a.raw)")

	// A size given below the minimum is the server's refusal, naming it.
	_, err = e.eitri("vm", "create", "web-2", "--image", "appliance", "--disk-gb", "2")
	require.Error(t, err)
	assert.Contains(t, err.Error(), "invalid argument: disk_gb: image appliance needs at least 6 GiB")
	_, err = e.eitri("vm", "create", "web-2", "--image", "nope")
	assert.ErrorAs(t, err, &ue)
	assert.Contains(t, err.Error(), `no image named "nope"`)

	// Pre-pull, followed until the host holds it; the catalogue then says so.
	_, err = e.eitri("image", "pull", "appliance")
	assert.ErrorAs(t, err, &ue, "hosts or --all")
	out, err = e.eitri("image", "pull", "appliance", "--host", "h1")
	require.NoError(t, err, out)
	assert.Regexp(t, `h1: holds it \(pinned\)\n$`, out)
	out, err = e.eitri("image", "ls")
	require.NoError(t, err)
	assert.Regexp(t, `address\s+1/1\s+ababababab`, out)
	out, err = e.eitri("image", "get", "appliance")
	require.NoError(t, err)
	assert.Regexp(t, `host h1\s+holds it \(pinned\)`, out)

	out, err = e.eitri("image", "rm", "appliance")
	require.NoError(t, err)
	assert.Contains(t, out, "removed appliance")
	out, err = e.eitri("image", "ls", "-o", "json")
	require.NoError(t, err)
	assert.JSONEq(t, `{"images":[]}`, out)
}
