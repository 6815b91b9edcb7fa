package release_test

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/wire/release"
)

func TestLinkedVersionIsFoundInAnyLdflagsSpelling(t *testing.T) {
	for in, want := range map[string]string{
		"-X main.version=v1.4":                "v1.4",
		"-s -w -X main.version=v1.4 -X a.b=c": "v1.4",
		"-X=main.version=v2":                  "v2",
		`-X 'main.version=v3'`:                "v3",
		"-X github.com/x/y.version=v1 -s":     "",
		"":                                    "",
	} {
		assert.Equal(t, want, release.LinkedVersion(in), in)
	}
}
