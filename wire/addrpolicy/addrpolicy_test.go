package addrpolicy

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestSSRFAddressClassification(t *testing.T) {
	refused := map[string]string{
		"0.0.0.0":                  "unspecified",
		"0.1.2.3":                  "unspecified",
		"127.0.0.1":                "loopback",
		"127.255.255.254":          "loopback",
		"10.1.2.3":                 "private",
		"172.16.0.1":               "private",
		"172.31.255.255":           "private",
		"192.168.77.1":             "private",
		"100.64.0.1":               "shared address space",
		"100.127.255.254":          "shared address space",
		"169.254.169.254":          "link-local",
		"192.0.0.8":                "IETF protocol assignments",
		"192.0.2.1":                "documentation",
		"198.51.100.7":             "documentation",
		"203.0.113.9":              "documentation",
		"192.88.99.1":              "6to4 relay anycast",
		"198.18.0.1":               "benchmarking",
		"224.0.0.1":                "multicast",
		"239.255.255.250":          "multicast",
		"240.0.0.1":                "reserved",
		"255.255.255.255":          "broadcast",
		"::":                       "unspecified",
		"::1":                      "loopback",
		"fe80::1":                  "link-local",
		"fe80::1%eth0":             "link-local",
		"fd00:ec2::254":            "unique local",
		"fc00::1":                  "unique local",
		"fec0::1":                  "site-local",
		"ff02::1":                  "multicast",
		"::ffff:127.0.0.1":         "loopback",
		"::ffff:169.254.169.254":   "link-local",
		"::ffff:10.0.0.1":          "private",
		"::127.0.0.1":              "reserved", // IPv4-compatible, deprecated
		"64:ff9b::a9fe:a9fe":       "link-local, via NAT64",
		"64:ff9b::7f00:1":          "loopback, via NAT64",
		"64:ff9b:1::a00:1":         "local-use NAT64",
		"2002:a9fe:a9fe::1":        "link-local, via 6to4",
		"2002:7f00:1::1":           "loopback, via 6to4",
		"2001:db8::1":              "documentation",
		"3fff::1":                  "documentation",
		"2001::1":                  "IETF protocol assignments",
		"100::1":                   "discard-only",
		"5f00::1":                  "segment routing",
		"4000::1":                  "reserved",
		"::ffff:0.0.0.0":           "unspecified",
		"::ffff:255.255.255.255":   "broadcast",
		"64:ff9b::c0a8:4d01":       "private, via NAT64",
		"::ffff:100.64.0.1":        "shared address space",
		"fe80::a9fe:a9fe":          "link-local",
		"fdff:ffff:ffff:ffff::1":   "unique local",
		"ff05::1:3":                "multicast",
		"::ffff:224.0.0.251":       "multicast",
		"2002:c0a8:0101::":         "private, via 6to4",
		"2002:0a00:0001:ffff::abc": "private, via 6to4",
	}
	for s, want := range refused {
		got := NonPublic(netip.MustParseAddr(s))
		assert.True(t, strings.HasPrefix(got, want), "%s: got %q, want %q", s, got, want)
	}
	for _, s := range []string{"1.1.1.1", "8.8.8.8", "151.101.1.1", "100.63.255.255", "100.128.0.0", "172.15.255.255",
		"172.32.0.0", "192.169.0.1", "169.253.255.255", "223.255.255.255", "2a00:1450:4001::1", "2606:4700::1111",
		"::ffff:1.1.1.1", "64:ff9b::101:101", "2002:101:101::1", "2001:4860:4860::8888"} {
		assert.Empty(t, NonPublic(netip.MustParseAddr(s)), "%s is public", s)
	}
}

func TestUnderPath(t *testing.T) {
	for p, want := range map[string]bool{
		"/guest-image/eitri-guest.raw":     true,
		"/guest-image/":                    true,
		"/guest-image":                     false,
		"/guest-image.json":                false,
		"/guest-image/../guest-image.json": false,
		"/guest-image/./x":                 false,
		"/guest-image//x":                  false,
		"/eitri.v1.VMService/ListVMs":      false,
		"/GUEST-IMAGE/x":                   false,
	} {
		assert.Equal(t, want, UnderPath(p, "/guest-image/"), p)
	}
}
