package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/a73x/eitri/cmd/eitri/cli"
	"github.com/a73x/eitri/cmd/eitri/internal/outputtest"
)

// The README's quickstart against a real dev instance and a real guest:
// eitri dev lists its test guest in the catalogue, a pull puts it in the
// host's cache, and a create by that name alone reaches ready with no
// download.
func TestTheQuickstartCreatesTheTestGuestByName(t *testing.T) {
	if !inNetns(t) {
		return
	}
	dir := t.TempDir()
	dev := startDevWith(t, dir, "--guest-image", filepath.Dir(os.Getenv("EITRI_GUEST_IMAGE")))
	defer dev.stop(t)
	dev.vms(t, dir) // the local host can take VMs
	tok, err := os.ReadFile(filepath.Join(dir, "control", "admin.token"))
	require.NoError(t, err)
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	t.Setenv("EITRI_URL", "")
	t.Setenv("EITRI_TOKEN", "")
	_, err = eitriIn("", "login", "http://127.0.0.1:18080", "--token", strings.TrimSpace(string(tok)))
	require.NoError(t, err)

	out, err := eitriIn("", "image", "ls")
	require.NoError(t, err)
	assert.Regexp(t, `test-guest\s+1\s+busybox`, out)

	// Pulled ahead: the host says so, and holds it.
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	var buf bytes.Buffer
	err = execute(ctx, []string{"image", "pull", "test-guest", "--all"}, cli.IO{In: strings.NewReader(""), Out: &buf, Err: &buf})
	t.Logf("\n%s", buf.String())
	require.NoError(t, err)
	assert.Regexp(t, `: holds it \(pinned\)\n$`, buf.String())

	// So the create by name downloads nothing.
	buf.Reset()
	err = execute(ctx, []string{"vm", "create", "web-1", "--image", "test-guest", "--wait"}, cli.IO{In: strings.NewReader(""), Out: &buf, Err: &buf})
	text := buf.String()
	t.Logf("\n%s", text)
	require.NoError(t, err)
	// Steps the host passes in a moment (booting) may be coalesced away
	// by the time a watcher reads them; these two always show.
	outputtest.LinesInOrder(t, text, []string{"creating: preparing root disk", "ready at 10.79.0."})
	// The image step says "using the cached image" (gone too soon, like
	// booting, for a watcher to be sure to read it); nothing says a
	// download, not even for the moment the cache lookup takes.
	assert.NotContains(t, text, "downloading image", "the pulled image is in the host's cache: nothing was fetched")

	out, err = eitriIn("", "vm", "get", "web-1")
	require.NoError(t, err)
	assert.Contains(t, out, "test-guest version 1 (http://127.0.0.1:18080/guest-image/")
}
