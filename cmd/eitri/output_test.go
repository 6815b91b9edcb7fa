package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/testing/protocmp"

	"github.com/a73x/eitri/cmd/eitri/cli"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server"
)

// readYAML reads -o yaml back into m, by way of JSON: the YAML must be the
// API's JSON, names and types, in another syntax.
func readYAML(t *testing.T, y string, m proto.Message) {
	t.Helper()
	var v any
	require.NoError(t, yaml.Unmarshal([]byte(y), &v), y)
	js, err := json.Marshal(v)
	require.NoError(t, err)
	require.NoError(t, protojson.Unmarshal(js, m), string(js))
}

func TestOutputJSONAndYAMLParseBackToTheSameMessage(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	h := e.connectHost("h1")
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "running", Phase: "ready", Ip: "10.77.0.5"}
	})
	_, err := e.eitri("vm", "create", "web-1", "--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32), "--mem-mb", "768", "--wait")
	require.NoError(t, err)
	// --wait ends on the live report; the row's stored status follows it a
	// moment later, and the calls below must read one settled VM.
	require.Eventually(t, func() bool {
		js, err := e.eitri("vm", "get", "web-1", "-o", "json")
		var r eitriv1.GetVMResponse
		return err == nil && protojson.Unmarshal([]byte(js), &r) == nil && r.GetVm().GetStatus() == "ready"
	}, 10*time.Second, 20*time.Millisecond, "the stored status catches up with the report")

	cases := []struct {
		args []string
		msg  func() proto.Message
		// a name the API speaks (snake_case) and its value, in the JSON.
		path  []string
		value any
	}{
		{[]string{"vm", "ls"}, func() proto.Message { return &eitriv1.ListVMsResponse{} }, []string{"vms", "0", "mem_mb"}, "768"},
		{[]string{"vm", "get", "web-1"}, func() proto.Message { return &eitriv1.GetVMResponse{} }, []string{"vm", "assigned_ip"}, "10.77.0.5"},
		{[]string{"host", "ls"}, func() proto.Message { return &eitriv1.ListHostsResponse{} }, []string{"hosts", "0", "agent_version"}, "test"},
		{[]string{"quota", "get"}, func() proto.Message { return &eitriv1.GetQuotaResponse{} }, []string{"quota", "user_name"}, "admin"},
		{[]string{"vm", "events", "web-1"}, func() proto.Message { return &eitriv1.ListVMEventsResponse{} }, []string{"events", "0", "kind"}, "created"},
	}
	for _, c := range cases {
		js, err := e.eitri(append(c.args, "-o", "json")...)
		require.NoError(t, err, c.args)
		fromJSON := c.msg()
		require.NoError(t, protojson.Unmarshal([]byte(js), fromJSON), js)
		var tree any
		require.NoError(t, json.Unmarshal([]byte(js), &tree))
		assert.Equal(t, c.value, dig(tree, c.path...), "%v: %v, snake_case as the API speaks", c.args, c.path)

		y, err := e.eitri(append(c.args, "-o", "yaml")...)
		require.NoError(t, err, c.args)
		assert.False(t, strings.HasPrefix(y, "{"), "%v: block YAML, not JSON: %s", c.args, y)
		fromYAML := c.msg()
		readYAML(t, y, fromYAML)
		// Two calls apart: a host's live readings may move between them.
		live := protocmp.IgnoreFields(&eitriv1.Host{}, "last_seen_at", "metrics")
		assert.Empty(t, cmp.Diff(fromJSON, fromYAML, protocmp.Transform(), live), "%v: -o yaml carries the same message as -o json", c.args)

		table, err := e.eitri(append(c.args, "-o", "table")...)
		require.NoError(t, err)
		assert.NotContains(t, table, "{")
	}

	_, err = e.eitri("vm", "ls", "-o", "xml")
	var ue cli.UsageError
	require.ErrorAs(t, err, &ue)
	assert.Contains(t, err.Error(), "want one of table, json, yaml")
}

// dig walks decoded JSON by keys and list indexes.
func dig(v any, path ...string) any {
	for _, p := range path {
		switch x := v.(type) {
		case map[string]any:
			v = x[p]
		case []any:
			i, err := strconv.Atoi(p)
			if err != nil || i >= len(x) {
				return nil
			}
			v = x[i]
		default:
			return nil
		}
	}
	return v
}

func TestVMNamesAreAcceptedWhereverIDsAre(t *testing.T) {
	e := newCLIEnv(t, server.Config{})
	h := e.connectHost("h1")
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: d.GetPowerState(), Phase: map[string]string{"running": "ready", "stopped": "stopped"}[d.GetPowerState()], Ip: "10.77.0.5"}
	})
	image := []string{"--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32)}
	out, err := e.eitri(append([]string{"vm", "create", "web", "-o", "json"}, image...)...)
	require.NoError(t, err)
	var mine eitriv1.CreateVMResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &mine))

	// alice has a VM of the same name; the admin sees both.
	out, err = e.eitri("token", "create", "laptop", "--user", "alice", "-o", "json")
	require.NoError(t, err)
	var tok eitriv1.CreateTokenResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &tok))
	admin := os.Getenv("EITRI_TOKEN")
	t.Setenv("EITRI_TOKEN", tok.Secret)
	out, err = e.eitri(append([]string{"vm", "create", "web", "-o", "json", "--stopped"}, image...)...)
	require.NoError(t, err)
	var hers eitriv1.CreateVMResponse
	require.NoError(t, protojson.Unmarshal([]byte(out), &hers))

	// Among alice's own VMs the name is hers alone.
	for _, args := range [][]string{{"vm", "get", "web"}, {"vm", "events", "web"}, {"vm", "wait", "web"}, {"expose", "ls", "web"}, {"vm", "start", "web"}} {
		_, err := e.eitri(args...)
		require.NoError(t, err, args)
	}
	out, err = e.eitri("vm", "get", "web")
	require.NoError(t, err)
	assert.Contains(t, out, hers.Vm.Id)
	out, err = e.eitri("expose", "create", "web", "80", "--local")
	require.NoError(t, err, "a port is published on a VM named by its name")
	assert.Contains(t, out, hers.Vm.Id)
	_, err = e.eitri("vm", "get", mine.Vm.Id)
	assert.Error(t, err, "another owner's VM is not alice's, by id or by name")

	t.Setenv("EITRI_TOKEN", admin)
	_, err = e.eitri("vm", "stop", "web")
	require.Error(t, err)
	assert.Equal(t, `2 VMs are named "web": `+mine.Vm.Id+" (owner "+mine.Vm.OwnerId+"), "+hers.Vm.Id+" (owner "+hers.Vm.OwnerId+"); give the id", err.Error(),
		"an admin sees both: the name is ambiguous, and nothing is stopped")
	out, err = e.eitri("vm", "stop", mine.Vm.Id)
	require.NoError(t, err, "the id settles it")
	assert.Contains(t, out, "stopping")
	_, err = e.eitri("vm", "get", "nope")
	assert.EqualError(t, err, `no VM has the id or name "nope"`)

	// Hosts too.
	out, err = e.eitri("host", "get", "h1")
	require.NoError(t, err)
	assert.Contains(t, out, "h1")
	_, err = e.eitri("host", "get", "h2")
	assert.EqualError(t, err, `no host has the id or name "h2"`)
	out, err = e.eitri(append([]string{"vm", "create", "db", "--host", "h1"}, image...)...)
	require.NoError(t, err, "--host takes a name")
	assert.Contains(t, out, "db")
}

func TestCompletionScriptsGenerate(t *testing.T) {
	cases := []struct{ shell, marker string }{
		{"bash", "__start_eitri"},
		{"zsh", "#compdef eitri"},
		{"fish", "complete -c eitri"},
	}
	for _, c := range cases {
		out, err := eitriIn("", "completion", c.shell)
		require.NoError(t, err, c.shell)
		assert.Contains(t, out, c.marker, c.shell)
		if sh, err := exec.LookPath(c.shell); err == nil {
			// The shell itself parses it (no run).
			f := filepath.Join(t.TempDir(), "eitri."+c.shell)
			require.NoError(t, os.WriteFile(f, []byte(out), 0o600))
			b, err := exec.Command(sh, "-n", f).CombinedOutput()
			assert.NoError(t, err, "%s -n: %s", c.shell, b)
		}
	}
	// The scripts ask eitri what to offer: the output formats, and the
	// caller's VMs by name.
	out, err := eitriIn("", "__complete", "vm", "ls", "-o", "")
	require.NoError(t, err)
	assert.Equal(t, "table\njson\nyaml\n:4\n", out, "-o offers its formats, and no file names")
	e := newCLIEnv(t, server.Config{})
	h := e.connectHost("h1")
	h.set(func(d *eitriv1.VMDesired) *eitriv1.ActualVM {
		return &eitriv1.ActualVM{VmId: d.GetVmId(), Power: "running", Phase: "ready", Ip: "10.77.0.5"}
	})
	_, err = e.eitri("vm", "create", "web-1", "--image", "http://images.test/g.raw", "--sha256", strings.Repeat("ab", 32))
	require.NoError(t, err)
	out, err = eitriIn("", "__complete", "vm", "get", "")
	require.NoError(t, err)
	assert.Regexp(t, "^web-1\t\\S+ vm-\\S+\n:4\n$", out, "the caller's VMs by name, with their state")
}
