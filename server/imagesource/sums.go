package imagesource

import (
	"bufio"
	"bytes"
	"fmt"
	"regexp"
	"strings"
)

// Algorithm names a digest a SUMS file can carry.
type Algorithm string

const (
	SHA256 Algorithm = "sha256"
	SHA512 Algorithm = "sha512"
)

// Digest is one SUMS entry's digest of a file.
type Digest struct {
	Algorithm Algorithm
	Hex       string // lowercase
}

var (
	// GNU coreutils: "<hex>  <name>" (text mode) or "<hex> *<name>"
	// (binary mode).
	gnuLine = regexp.MustCompile(`^([0-9a-fA-F]+) [ *](.+)$`)
	// BSD tagged: "SHA256 (<name>) = <hex>".
	bsdLine = regexp.MustCompile(`^(SHA256|SHA512) \((.+)\) = ([0-9a-fA-F]+)$`)
)

// ParseSums finds fileName's digest in a SHA256SUMS or SHA512SUMS file (GNU
// or BSD tagged lines; the algorithm is told by the digest's length, or the
// tag). Names match exactly, or by their last path segment when the file
// lists paths ("./debian-12.qcow2", "images/debian-12.qcow2"). A name
// listed twice with different digests is refused: the file does not say
// which it means.
func ParseSums(data []byte, fileName string) (Digest, error) {
	if fileName == "" {
		return Digest{}, fmt.Errorf("no file name to look for")
	}
	var found []Digest
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 4096), 64<<10)
	lines := 0
	for sc.Scan() {
		line := strings.TrimRight(sc.Text(), "\r")
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		var hex, name string
		if m := bsdLine.FindStringSubmatch(line); m != nil {
			name, hex = m[2], m[3]
		} else if m := gnuLine.FindStringSubmatch(line); m != nil {
			hex, name = m[1], m[2]
		} else {
			continue // a signed SUMS may carry other text; only entries count
		}
		lines++
		if name != fileName && lastSegment(name) != fileName {
			continue
		}
		d := Digest{Hex: strings.ToLower(hex)}
		switch len(hex) {
		case 64:
			d.Algorithm = SHA256
		case 128:
			d.Algorithm = SHA512
		default:
			return Digest{}, fmt.Errorf("the entry for %q has a digest of %d hex characters, neither sha256 (64) nor sha512 (128)", fileName, len(hex))
		}
		found = append(found, d)
	}
	if err := sc.Err(); err != nil {
		return Digest{}, fmt.Errorf("not a SUMS file: %v", err)
	}
	switch {
	case lines == 0:
		return Digest{}, fmt.Errorf("not a SUMS file: no line of the form \"<hex digest>  <file name>\"")
	case len(found) == 0:
		return Digest{}, fmt.Errorf("lists no file named %q", fileName)
	}
	for _, d := range found[1:] {
		if d != found[0] {
			return Digest{}, fmt.Errorf("lists %q more than once with different digests", fileName)
		}
	}
	return found[0], nil
}

func lastSegment(p string) string {
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		return p[i+1:]
	}
	return p
}
