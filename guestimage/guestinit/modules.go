//go:build linux

package main

import (
	"bufio"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"
)

// loadModules loads every module named in the order file (one path per line,
// dependencies first, written by build.sh). A few passes forgive a list that
// is slightly out of order: a module whose dependency is not in yet fails
// with ENOENT or EINVAL and succeeds on the next pass.
func loadModules(orderFile string) {
	f, err := os.Open(orderFile)
	if err != nil {
		slog.Warn("no module list", "err", err)
		return
	}
	var pending []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if line := strings.TrimSpace(sc.Text()); line != "" {
			pending = append(pending, filepath.Join(filepath.Dir(orderFile), line))
		}
	}
	f.Close()

	errs := map[string]error{}
	for pass := 0; pass < 3 && len(pending) > 0; pass++ {
		var failed []string
		for _, path := range pending {
			if err := loadModule(path); err != nil {
				errs[path] = err
				failed = append(failed, path)
				continue
			}
			delete(errs, path)
		}
		pending = failed
	}
	for path, err := range errs {
		slog.Warn("module not loaded", "module", filepath.Base(path), "err", err)
	}
}

func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	err = unix.FinitModule(int(f.Fd()), "", 0)
	if errors.Is(err, unix.EEXIST) {
		return nil
	}
	return err
}
