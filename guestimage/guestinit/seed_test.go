//go:build linux

package main

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// The guest must read back what agent/seed writes (double-quoted) as well as
// what hand-made seeds usually hold (plain or single-quoted).
func TestYAMLScalar(t *testing.T) {
	cases := []struct{ in, want string }{
		{` "web-1"`, "web-1"},
		{` "a \"q\" \\ b"`, `a "q" \ b`},
		{` web-1`, "web-1"},
		{` web-1 # comment`, "web-1"},
		{` 'it''s'`, "it's"},
		{` "on"`, "on"},
	}
	for _, tc := range cases {
		t.Run(tc.in, func(t *testing.T) {
			assert.Equal(t, tc.want, yamlScalar(tc.in))
		})
	}
}

func TestPhoneHomeURL(t *testing.T) {
	ud := "#cloud-config\nhostname: \"web-1\"\nusers:\n  - name: \"eitri\"\n    url: \"not this\"\n" +
		"phone_home:\n  url: \"http://10.77.0.1:7480/eitri/phone-home/vm-1/abc\"\n  post: [instance_id]\n" +
		"write_files:\n  - path: /x\n    content: |\n      url: 'nor this'\n"
	assert.Equal(t, "http://10.77.0.1:7480/eitri/phone-home/vm-1/abc", phoneHomeURL(ud))
	assert.Empty(t, phoneHomeURL("#cloud-config\nhostname: x\n"))
}
