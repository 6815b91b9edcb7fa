// Package addrpolicy decides which addresses a download of a URL someone
// else named may connect to: the agent's image downloads and the control
// plane's catalogue fetches share it, so one rule keeps both off loopback,
// private networks and metadata services.
package addrpolicy

import (
	"fmt"
	"net/netip"
	"path"
	"strings"
)

// Policy decides which addresses downloads of caller-named URLs may
// connect to (images, and the SUMS, signature and keyring files of the
// image catalogue). An
// image URL is named by whoever creates a VM, so without a policy anyone with
// a token could make the agent fetch from the host's loopback, its LAN or a
// cloud metadata service and learn what answered.
//
// The check runs on the address actually being dialed (net.Dialer's Control
// hook), after name resolution and for every redirect, so a name that
// resolves to something else on the second lookup gains nothing.
//
// The zero policy admits public unicast addresses only.
type Policy struct {
	// Allow admits every address inside these prefixes, whatever kind they
	// are: an operator's own mirrors on a private network.
	Allow []netip.Prefix
	// Endpoints admit one address and port each, for some paths only.
	Endpoints []Endpoint
	// Hint is appended to every refusal, to tell the reader how an address
	// can be allowed (the flag that does it is the caller's business).
	Hint string
}

// Endpoint admits requests to one address and port whose URL path lies under
// PathPrefix ("" admits every path). eitri dev uses it to let its agent fetch
// the test guest that the dev server itself serves on loopback, and nothing
// else on that port.
type Endpoint struct {
	AddrPort   netip.AddrPort
	PathPrefix string
}

// RefusedError is a connection the policy did not allow. It names the
// address that was refused and why, never anything the address answered: no
// connection was made.
type RefusedError struct {
	// Field names the request field whose URL was refused ("image_url"
	// when empty).
	Field  string
	Addr   netip.Addr
	Reason string // "private", "loopback", "link-local", ...
	Hint   string
	// Redirect is which redirect led there; 0 is the URL itself.
	Redirect int
}

func (e *RefusedError) Error() string {
	field := e.Field
	if field == "" {
		field = "image_url"
	}
	s := fmt.Sprintf("%s: address %s is not allowed for image downloads (%s)", field, e.Addr, e.Reason)
	if e.Redirect > 0 {
		s = fmt.Sprintf("%s: redirect %d leads to address %s, which is not allowed for image downloads (%s)", field, e.Redirect, e.Addr, e.Reason)
	}
	if e.Hint != "" {
		s += "; " + e.Hint
	}
	return s
}

// Permanent: the same URL would be refused again; the agent fails the
// create at once instead of retrying.
func (e *RefusedError) Permanent() bool { return true }

// check allows or refuses a connection to ap made for a request whose URL
// path is urlPath.
func (p Policy) Check(ap netip.AddrPort, urlPath string) error {
	raw := ap.Addr().WithZone("")
	ip := raw.Unmap()
	for _, pre := range p.Allow {
		if unmapPrefix(pre).Contains(ip) {
			return nil
		}
	}
	why := NonPublic(raw)
	for _, e := range p.Endpoints {
		if e.AddrPort.Addr().WithZone("").Unmap() != ip || e.AddrPort.Port() != ap.Port() {
			continue
		}
		if UnderPath(urlPath, e.PathPrefix) {
			return nil
		}
		if why != "" {
			why += fmt.Sprintf("; only paths under %s are allowed on %s", e.PathPrefix, e.AddrPort)
		}
	}
	if why == "" {
		return nil
	}
	return &RefusedError{Addr: ip, Reason: why, Hint: p.Hint}
}

// unmapPrefix turns an IPv4-mapped prefix (::ffff:10.0.0.0/104) into the
// IPv4 one it means, as addresses are compared unmapped.
func unmapPrefix(p netip.Prefix) netip.Prefix {
	if a := p.Addr(); a.Is4In6() && p.Bits() >= 96 {
		return netip.PrefixFrom(a.Unmap(), p.Bits()-96)
	}
	return p
}

// UnderPath reports whether the URL path p lies under prefix. Dot segments
// are refused outright rather than cleaned: a server may resolve them
// differently from us, and an image URL has no reason to carry them.
func UnderPath(p, prefix string) bool {
	if prefix == "" {
		return true
	}
	if !strings.HasPrefix(p, prefix) {
		return false
	}
	for seg := range strings.SplitSeq(p, "/") {
		if seg == "." || seg == ".." {
			return false
		}
	}
	return path.Clean(p) == p || path.Clean(p)+"/" == p
}

type special struct {
	pre netip.Prefix
	why string
}

func specials(why string, prefixes ...string) []special {
	out := make([]special, len(prefixes))
	for i, s := range prefixes {
		out[i] = special{netip.MustParsePrefix(s), why}
	}
	return out
}

// Not reachable as ordinary public hosts: the IANA IPv4 and IPv6
// special-purpose registries, less the few entries that are globally
// reachable services (AS112, AMT). Checked in order; the first match names
// the reason.
var (
	special4 = concat(
		specials("unspecified (this network)", "0.0.0.0/8"),
		specials("loopback", "127.0.0.0/8"),
		specials("private", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"),
		specials("shared address space (carrier-grade NAT)", "100.64.0.0/10"),
		specials("link-local", "169.254.0.0/16"),
		specials("IETF protocol assignments", "192.0.0.0/24"),
		specials("documentation", "192.0.2.0/24", "198.51.100.0/24", "203.0.113.0/24"),
		specials("6to4 relay anycast (deprecated)", "192.88.99.0/24"),
		specials("benchmarking", "198.18.0.0/15"),
		specials("multicast", "224.0.0.0/4"),
		specials("broadcast", "255.255.255.255/32"),
		specials("reserved", "240.0.0.0/4"),
	)
	special6 = concat(
		specials("unspecified", "::/128"),
		specials("loopback", "::1/128"),
		specials("link-local", "fe80::/10"),
		specials("unique local (private)", "fc00::/7"),
		specials("site-local (deprecated)", "fec0::/10"),
		specials("multicast", "ff00::/8"),
		specials("local-use NAT64", "64:ff9b:1::/48"),
		specials("discard-only", "100::/64"),
		specials("documentation", "2001:db8::/32", "3fff::/20"),
		specials("IETF protocol assignments (Teredo, ORCHID, ...)", "2001::/23"),
		specials("segment routing", "5f00::/16"),
	)
	// Only 2000::/3 is allocated for global unicast; the rest of the space
	// (IPv4-compatible ::a.b.c.d among it) is reserved.
	global6 = netip.MustParsePrefix("2000::/3")
	// Prefixes that embed an IPv4 address, which decides for them.
	nat64     = netip.MustParsePrefix("64:ff9b::/96")
	sixToFour = netip.MustParsePrefix("2002::/16")
)

func concat(lists ...[]special) []special {
	var out []special
	for _, l := range lists {
		out = append(out, l...)
	}
	return out
}

// NonPublic says why ip is not an ordinary public unicast address, or ""
// when it is one. IPv4-mapped IPv6 addresses, NAT64 (64:ff9b::/96) and
// 6to4 (2002::/16) addresses are judged by the IPv4 address they carry, so
// ::ffff:127.0.0.1 or 2002:a9fe:a9fe:: are no way around the IPv4 rules.
func NonPublic(ip netip.Addr) string {
	ip = ip.WithZone("")
	switch {
	case !ip.IsValid():
		return "invalid"
	case ip.Is4In6():
		return NonPublic(ip.Unmap())
	case ip.Is4():
		for _, s := range special4 {
			if s.pre.Contains(ip) {
				return s.why
			}
		}
		return ""
	}
	b := ip.As16()
	if nat64.Contains(ip) {
		if why := NonPublic(netip.AddrFrom4([4]byte(b[12:16]))); why != "" {
			return why + ", via NAT64"
		}
		return ""
	}
	for _, s := range special6 {
		if s.pre.Contains(ip) {
			return s.why
		}
	}
	if !global6.Contains(ip) {
		return "reserved"
	}
	if sixToFour.Contains(ip) {
		if why := NonPublic(netip.AddrFrom4([4]byte(b[2:6]))); why != "" {
			return why + ", via 6to4"
		}
	}
	return ""
}
