package main

import (
	"testing"

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
