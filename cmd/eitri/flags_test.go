package main

import (
	"testing"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
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
		assert.NoError(t, fs.Parse([]string{"--usage-every", arg}))
		cfg, err := a.config(nil)
		if ok {
			assert.NoError(t, err, arg)
			assert.Equal(t, arg, cfg.UsageEvery.String())
		} else {
			assert.ErrorContains(t, err, "--usage-every", arg)
		}
	}
}
