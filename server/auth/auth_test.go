package auth_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/server/auth"
)

func TestSecretReadsTheBearerSchemeInAnyCase(t *testing.T) {
	cases := []struct {
		header, want string
	}{
		{"Bearer eitri_pat_x", "eitri_pat_x"},
		{"bearer eitri_pat_x", "eitri_pat_x"},
		{"BEARER eitri_pat_x", "eitri_pat_x"},
		{"bEaReR eitri_pat_x", "eitri_pat_x"},
		{"Bearer   eitri_pat_x  ", "eitri_pat_x"},
		{"", ""},
		{"Bearer", ""},
		{"Bearereitri_pat_x", ""},
		{"Basic dXNlcjpwYXNz", ""},
		{"Token eitri_pat_x", ""},
	}
	for _, c := range cases {
		h := http.Header{}
		if c.header != "" {
			h.Set("Authorization", c.header)
		}
		assert.Equal(t, c.want, auth.Secret(h), "Authorization: %q", c.header)
	}
}
