package release

import (
	"debug/buildinfo"
	"errors"
	"fmt"
	"strings"
)

// Inspect reads what a Go binary says it is: its platform from its build
// settings, and its version from the -X main.version=… it was linked with
// (the way eitri is built). Version is empty when it was not set that way;
// the caller then has to be told it.
func Inspect(path string) (Build, error) {
	bi, err := buildinfo.ReadFile(path)
	if err != nil {
		return Build{}, fmt.Errorf("%s: not a Go binary eitri can read: %w", path, err)
	}
	var b Build
	for _, s := range bi.Settings {
		switch s.Key {
		case "GOOS":
			b.OS = s.Value
		case "GOARCH":
			b.Arch = s.Value
		case "-ldflags":
			b.Version = linkedVersion(s.Value)
		}
	}
	if b.OS == "" || b.Arch == "" {
		return b, errors.New(path + ": the binary does not say its platform")
	}
	d, err := SumFile(path)
	if err != nil {
		return b, err
	}
	b.SHA256, b.Size = d.SHA256, d.Size
	return b, nil
}

// linkedVersion finds -X main.version=V in an -ldflags value.
func linkedVersion(ldflags string) string {
	f := strings.Fields(ldflags)
	for i, w := range f {
		v := ""
		switch {
		case w == "-X" && i+1 < len(f):
			v = f[i+1]
		case strings.HasPrefix(w, "-X="):
			v = strings.TrimPrefix(w, "-X=")
		}
		if after, ok := strings.CutPrefix(strings.Trim(v, `'"`), "main.version="); ok {
			return strings.Trim(after, `'"`)
		}
	}
	return ""
}
