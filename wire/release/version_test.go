package release_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/wire/release"
)

func TestVersionsAreOrderedByTheirNumbers(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want int
	}{
		{"v1.10", "v1.9", 1},
		{"v1.4", "v1.4.0", 0},
		{"1.4.1", "v1.4", 1},
		{"v1.4.0-rc1", "v1.4.0", -1},
		{"v1.4.0-rc1", "v1.4.0-rc2", -1},
		{"v2.0", "v1.99", 1},
	} {
		c, ok := release.CompareVersions(tc.a, tc.b)
		assert.True(t, ok, "%s vs %s", tc.a, tc.b)
		assert.Equal(t, tc.want, c, "%s vs %s", tc.a, tc.b)
	}
}

func TestAnUnnumberedVersionHasNoOrder(t *testing.T) {
	for _, pair := range [][2]string{{"dev", "v1.4"}, {"v1.4", "dev"}, {"v1.x", "v1.4"}, {"", "v1"}} {
		_, ok := release.CompareVersions(pair[0], pair[1])
		assert.False(t, ok, "%q vs %q", pair[0], pair[1])
	}
}

func TestMinorsBehind(t *testing.T) {
	assert.Equal(t, 1, release.MinorsBehind("v1.3.2", "v1.4.0"))
	assert.Equal(t, 2, release.MinorsBehind("v1.2", "v1.4"))
	assert.Equal(t, 0, release.MinorsBehind("v1.4", "v1.4.9"))
	assert.Equal(t, 0, release.MinorsBehind("v1.5", "v1.4"))
	assert.Equal(t, 0, release.MinorsBehind("dev", "v1.4"))
	assert.Greater(t, release.MinorsBehind("v1.9", "v2.0"), 1, "a major version behind is more than one")
}
