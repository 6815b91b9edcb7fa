package release

import (
	"cmp"
	"strconv"
	"strings"
)

// CompareVersions orders two versions by their numbers, so v1.10 comes
// after v1.9 and v1.4.0-rc1 before v1.4.0. ok is false when either is not
// numbered that way (a "dev" build): such a pair has no order, and callers
// must not call one a downgrade of the other.
func CompareVersions(a, b string) (c int, ok bool) {
	an, apre, aok := parseVersion(a)
	bn, bpre, bok := parseVersion(b)
	if !aok || !bok {
		return 0, false
	}
	for i := range max(len(an), len(bn)) {
		var x, y int
		if i < len(an) {
			x = an[i]
		}
		if i < len(bn) {
			y = bn[i]
		}
		if c := cmp.Compare(x, y); c != 0 {
			return c, true
		}
	}
	switch {
	case apre == bpre:
		return 0, true
	case apre == "": // a release comes after its pre-releases
		return 1, true
	case bpre == "":
		return -1, true
	}
	return strings.Compare(apre, bpre), true
}

// MinorsBehind is how many minor versions older a is than b (0 when it is
// not older, or either has no order), within one major version; a major
// version behind counts as many.
func MinorsBehind(a, b string) int {
	an, _, aok := parseVersion(a)
	bn, _, bok := parseVersion(b)
	if !aok || !bok {
		return 0
	}
	part := func(n []int, i int) int {
		if i < len(n) {
			return n[i]
		}
		return 0
	}
	switch {
	case part(an, 0) < part(bn, 0):
		return 1 << 16
	case part(an, 0) > part(bn, 0):
		return 0
	}
	return max(0, part(bn, 1)-part(an, 1))
}

func parseVersion(v string) (nums []int, pre string, ok bool) {
	v = strings.TrimPrefix(v, "v")
	if i := strings.IndexByte(v, '+'); i >= 0 {
		v = v[:i] // build metadata has no order
	}
	v, pre, _ = strings.Cut(v, "-")
	if v == "" {
		return nil, "", false
	}
	for p := range strings.SplitSeq(v, ".") {
		n, err := strconv.Atoi(p)
		if err != nil || n < 0 {
			return nil, "", false
		}
		nums = append(nums, n)
	}
	return nums, pre, true
}
