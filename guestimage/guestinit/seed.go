//go:build linux

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

type identity struct {
	Hostname   string
	InstanceID string
	Source     string // the device the seed came from, for the console log
	// PhoneHomeURL is the URL eitri's phone-home unit posts to (see
	// phoneHomeURL): the test guest posts to it once it has its address,
	// as the unit does once cloud-init is done.
	PhoneHomeURL string
}

const seedMount = "/run/cidata"

// readSeed finds the NoCloud seed among the block devices and reads its
// meta-data. Disks appear asynchronously after their drivers load, so it
// keeps looking until wait runs out; a guest without a seed still comes up,
// under a name that says so.
func readSeed(ctx context.Context, wait time.Duration) identity {
	deadline := time.Now().Add(wait)
	for {
		for _, dev := range candidateDevices() {
			if id, ok := trySeed(dev); ok {
				return id
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			slog.Warn("no cidata seed found")
			return identity{Hostname: "eitri-guest", InstanceID: "none", Source: "none"}
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func candidateDevices() []string {
	var out []string
	for _, pat := range []string{"/dev/vd*", "/dev/sr*", "/dev/sd*"} {
		m, _ := filepath.Glob(pat)
		for _, d := range m {
			// Whole disks only: a seed is never a partition.
			if last := d[len(d)-1]; last >= '0' && last <= '9' && !strings.HasPrefix(d, "/dev/sr") {
				continue
			}
			out = append(out, d)
		}
	}
	return out
}

func trySeed(dev string) (identity, bool) {
	if err := os.MkdirAll(seedMount, 0o755); err != nil {
		return identity{}, false
	}
	if err := unix.Mount(dev, seedMount, "iso9660", unix.MS_RDONLY, ""); err != nil {
		return identity{}, false
	}
	defer unix.Unmount(seedMount, 0)

	md, err := os.ReadFile(filepath.Join(seedMount, "meta-data"))
	if err != nil {
		return identity{}, false
	}
	id := identity{Source: dev}
	sc := bufio.NewScanner(strings.NewReader(string(md)))
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(key) {
		case "instance-id":
			id.InstanceID = yamlScalar(val)
		case "local-hostname":
			id.Hostname = yamlScalar(val)
		}
	}
	if id.Hostname == "" {
		id.Hostname = "eitri-guest"
	}
	if ud, err := os.ReadFile(filepath.Join(seedMount, "user-data")); err == nil {
		id.PhoneHomeURL = phoneHomeURL(string(ud))
	}
	return id, true
}

// phoneHomeScript is where eitri's seed (agent/seed) writes the script its
// phone-home unit runs; the script names its URL on a line starting
// phoneHomeURLPrefix. The test guest has neither systemd nor Python, so it
// reads the URL from there and posts itself.
const (
	phoneHomeScript    = "/usr/local/lib/eitri/phone-home"
	phoneHomeURLPrefix = "URL = "
)

// phoneHomeURL finds the phone-home URL in a #cloud-config document: the
// first line starting phoneHomeURLPrefix in the content of the write_files
// entry for phoneHomeScript.
func phoneHomeURL(userData string) string {
	inFiles, inScript := false, false
	for _, line := range strings.Split(userData, "\n") {
		if line == "" {
			continue
		}
		if line[0] != ' ' && line[0] != '\t' {
			inFiles, inScript = strings.TrimSpace(line) == "write_files:", false
			continue
		}
		trimmed := strings.TrimSpace(line)
		if !inFiles {
			continue
		}
		if rest, ok := strings.CutPrefix(trimmed, "- path:"); ok {
			inScript = yamlScalar(rest) == phoneHomeScript
			continue
		}
		if rest, ok := strings.CutPrefix(trimmed, phoneHomeURLPrefix); ok && inScript {
			return yamlScalar(rest)
		}
	}
	return ""
}

// yamlScalar reads the one-line scalars a NoCloud meta-data file holds:
// double-quoted (JSON-compatible), single-quoted or plain.
func yamlScalar(v string) string {
	v = strings.TrimSpace(v)
	switch {
	case strings.HasPrefix(v, `"`):
		var s string
		if json.Unmarshal([]byte(v), &s) == nil {
			return s
		}
		return strings.Trim(v, `"`)
	case strings.HasPrefix(v, "'") && strings.HasSuffix(v, "'") && len(v) >= 2:
		return strings.ReplaceAll(v[1:len(v)-1], "''", "'")
	}
	if i := strings.Index(v, " #"); i >= 0 {
		v = strings.TrimSpace(v[:i])
	}
	return v
}
