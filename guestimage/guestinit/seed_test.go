//go:build linux

package main

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/a73x/eitri/agent/seed"
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

// The guest finds the URL in the seed eitri writes, and nowhere else.
func TestPhoneHomeURL(t *testing.T) {
	const url = "http://10.77.0.1:7480/eitri/phone-home/vm-1/abc"
	ud := seed.UserData(seed.Params{InstanceID: "vm-1", Hostname: "web-1", PhoneHomeURL: url})
	assert.Equal(t, url, phoneHomeURL(ud), "from agent/seed's user-data:\n%s", ud)

	assert.Empty(t, phoneHomeURL(seed.UserData(seed.Params{InstanceID: "vm-1", Hostname: "web-1"})))
	assert.Empty(t, phoneHomeURL("#cloud-config\nhostname: x\n"))
	// The URL line counts only inside the phone-home script's entry.
	other := "#cloud-config\nruncmd:\n  - URL = \"http://a/\"\nwrite_files:\n  - path: /etc/x\n    content: |\n      URL = \"http://b/\"\n" +
		"  - path: \"" + phoneHomeScript + "\"\n    content: |\n      URL = \"http://c/\"\n"
	assert.Equal(t, "http://c/", phoneHomeURL(other))
}

// The guest's copies of the seed's names are the seed's.
func TestPhoneHomeNamesMatchTheSeed(t *testing.T) {
	assert.Equal(t, seed.PhoneHomeScript, phoneHomeScript)
	assert.Equal(t, seed.PhoneHomeURLPrefix, phoneHomeURLPrefix)
}
