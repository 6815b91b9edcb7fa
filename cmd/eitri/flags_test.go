package main

import (
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/server/fleet"
)

func TestPortRangeFlag(t *testing.T) {
	var p portRange
	assert.NoError(t, p.Set("40000-40010"))
	assert.Equal(t, portRange{40000, 40010}, p)
	for _, bad := range []string{"", "40000", "0-10", "10-5", "1-70000", "a-b"} {
		assert.Error(t, (&portRange{}).Set(bad), bad)
	}
}

func TestUsageEveryFlagMustBePositive(t *testing.T) {
	for arg, ok := range map[string]bool{"1s": true, "250ms": true, "0s": false, "-1s": false} {
		var a agentFlags
		fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
		a.register(fs)
		err := fs.Parse([]string{"--usage-every", arg})
		if !ok {
			assert.ErrorContains(t, err, "--usage-every", arg)
			continue
		}
		assert.NoError(t, err, arg)
		cfg, err := a.config(nil)
		assert.NoError(t, err, arg)
		assert.Equal(t, arg, cfg.UsageEvery.String())
	}
}

func TestUpgradeStuckAfterMustBePositiveOnServerAndDev(t *testing.T) {
	for _, cmd := range []*cobra.Command{newServerCmd(), newDevCmd()} {
		for _, bad := range []string{"0s", "-1s", "soon"} {
			assert.ErrorContains(t, cmd.Flags().Parse([]string{"--upgrade-stuck-after", bad}), "--upgrade-stuck-after", "%s %s", cmd.Name(), bad)
		}
		f := cmd.Flags().Lookup("upgrade-stuck-after")
		assert.Equal(t, fleet.DefaultStuckAfter.String(), f.DefValue, "%s: the default is the fleet's", cmd.Name())
		assert.NoError(t, cmd.Flags().Parse([]string{"--upgrade-stuck-after", "3s"}))
		assert.Equal(t, "3s", f.Value.String())
	}
}
