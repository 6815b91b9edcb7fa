package main

import (
	"bufio"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// unitDirectives reads a systemd unit into section.key → values.
func unitDirectives(t *testing.T, path string) map[string][]string {
	t.Helper()
	f, err := os.Open(path)
	require.NoError(t, err)
	defer f.Close()
	out := map[string][]string{}
	section := ""
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "" || strings.HasPrefix(line, "#"):
		case strings.HasPrefix(line, "["):
			section = strings.Trim(line, "[]")
		default:
			k, v, ok := strings.Cut(line, "=")
			require.True(t, ok, "%s: not key=value: %q", path, line)
			out[section+"."+k] = append(out[section+"."+k], v)
		}
	}
	require.NoError(t, sc.Err())
	return out
}

func TestSystemdUnitsRestartAndLeaveGuestsAlone(t *testing.T) {
	dir := filepath.Join("..", "..", "deploy", "systemd")
	agent := unitDirectives(t, filepath.Join(dir, "eitri-agent.service"))
	server := unitDirectives(t, filepath.Join(dir, "eitri-server.service"))

	for name, u := range map[string]map[string][]string{"agent": agent, "server": server} {
		assert.Equal(t, []string{"always"}, u["Service.Restart"], "%s restarts always", name)
		require.Len(t, u["Service.ExecStart"], 1, name)
		args := strings.Fields(u["Service.ExecStart"][0])
		assert.Equal(t, []string{"/usr/local/bin/eitri", name}, args[:2], "%s runs the one binary's %s command", name, name)
		assert.Contains(t, args, "--data-dir", name)
		assert.Equal(t, []string{"multi-user.target"}, u["Install.WantedBy"], name)
	}
	// Restarting the agent must not take the guests with it: only the agent
	// process is signalled, and the next agent adopts the running QEMUs.
	assert.Equal(t, []string{"process"}, agent["Service.KillMode"])
	assert.NotContains(t, server, "Service.KillMode", "the control plane has no children to spare")
	assert.Equal(t, []string{"yes"}, server["Service.DynamicUser"], "the control plane runs unprivileged")
}
