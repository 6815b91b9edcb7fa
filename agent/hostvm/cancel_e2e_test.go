package hostvm

import (
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/vishvananda/netlink"

	"github.com/a73x/eitri/agent/netsetup"
	"github.com/a73x/eitri/agent/qemu"
	"github.com/a73x/eitri/agent/reconcile"
	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
)

// cancelWithin bounds how long a deleted VM's create may take to let go: a
// correctness bound, not a speed goal.
const cancelWithin = 5 * time.Second

// TestDeletingAVMCancelsItsTrickledCreate replays the attack: an image
// server that trickles bytes holds the host's only create slot. Deleting
// that VM ends its download at once, leaves no partial file in the image
// cache, hands the slot to the queued VM (which boots), and keeps the
// deleted VM's record until its destroy_at like any soft-deleted VM.
func TestDeletingAVMCancelsItsTrickledCreate(t *testing.T) {
	inNetns(t, func(t *testing.T) {
		dir, url, sha := netnsEnv(t)
		const stuckID, queuedID = "vm-e2e-trickled", "vm-e2e-queued"
		killLeftovers(t, dir, stuckID, queuedID)

		aborted := make(chan struct{})
		trickle := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Length", strconv.Itoa(1<<30))
			for {
				if _, err := w.Write([]byte{0}); err != nil {
					close(aborted)
					return
				}
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
					close(aborted)
					return
				case <-time.After(10 * time.Millisecond):
				}
			}
		}))
		t.Cleanup(trickle.Close)

		h := startHost(t, dir, netip.MustParsePrefix("10.78.6.1/24"), true, func(_ *qemu.Config, e *reconcile.Config) {
			e.MaxConcurrentCreates = 1
		})
		t.Cleanup(func() { h.stop(t) })
		stuckSHA := strings.Repeat("7e", 32)
		imagesDir := filepath.Join(dir, "images")
		// The trickled image's work files (the queued VM downloads its own).
		partials := func() []string {
			ents, _ := os.ReadDir(imagesDir)
			var out []string
			for _, e := range ents {
				if strings.HasPrefix(e.Name(), stuckSHA) {
					out = append(out, e.Name())
				}
			}
			return out
		}

		stuck := desiredVM(stuckID, "trickled", trickle.URL+"/big.raw", stuckSHA, "running")
		queued := desiredVM(queuedID, "queued", url, sha, "running")
		require.True(t, h.eng.Apply(snapshot(1, stuck)))
		waitRow(t, h, stuckID, cancelWithin, "downloading", func(r *eitriv1.ActualVM) bool {
			return strings.HasPrefix(r.GetStatusDetail(), "downloading image")
		})
		require.Eventually(t, func() bool { return len(partials()) == 1 }, cancelWithin, 10*time.Millisecond,
			"precondition: the trickled download is being written")
		require.True(t, h.eng.Apply(snapshot(2, stuck, queued)))
		waitRow(t, h, queuedID, cancelWithin, "queued", func(r *eitriv1.ActualVM) bool {
			return r.GetStatusDetail() == "waiting for a create slot on this host"
		})

		del := desiredVM(stuckID, "trickled", stuck.GetImageUrl(), stuck.GetImageSha256(), "running")
		del.Deleted, del.DestroyAtUnix = true, time.Now().Add(time.Hour).Unix()
		start := time.Now()
		require.True(t, h.eng.Apply(snapshot(3, del, queued)))
		row := waitRow(t, h, stuckID, cancelWithin, "deleting, its create over", func(r *eitriv1.ActualVM) bool {
			return r.GetPhase() == "deleting" && r.GetStatusDetail() == ""
		})
		t.Logf("create cancelled after %s", time.Since(start).Round(time.Millisecond))
		assert.Empty(t, row.GetLastError())
		select {
		case <-aborted:
		case <-time.After(cancelWithin):
			t.Fatal("the image server is still sending to a deleted VM's create")
		}
		assert.Empty(t, partials(), "nothing of the trickled download is left in the image cache")
		_, err := os.Stat(filepath.Join(h.qemuDir(), stuckID))
		assert.ErrorIs(t, err, os.ErrNotExist, "no half-made disk")
		_, ok, err := h.st.LoadVM(stuckID)
		require.NoError(t, err)
		assert.True(t, ok, "soft-deleted: the record stays until destroy_at")

		waitRow(t, h, queuedID, readyWithin, "ready", isReady)

		// Its time comes: destroyed like any soft-deleted VM, and so is the
		// other, leaving the host clean.
		gone := desiredVM(queuedID, "queued", url, sha, "running")
		gone.Deleted, gone.DestroyAtUnix = true, time.Now().Add(-time.Minute).Unix()
		del.DestroyAtUnix = time.Now().Add(-time.Minute).Unix()
		gone.Destroy, del.Destroy = true, true // the control plane's clock passed destroy_at
		require.True(t, h.eng.Apply(snapshot(4, del, gone)))
		require.Eventually(t, func() bool {
			rep := h.eng.Report()
			return slices.Contains(rep.GetDestroyed(), stuckID) && slices.Contains(rep.GetDestroyed(), queuedID)
		}, stoppedWithin, 100*time.Millisecond, "both destroyed")
		ents, err := os.ReadDir(h.qemuDir())
		require.NoError(t, err)
		assert.Empty(t, ents, "QEMU's directory is empty")
		ids, err := h.st.ListVMs()
		require.NoError(t, err)
		assert.Empty(t, ids, "no records left")
		for _, id := range []string{stuckID, queuedID} {
			_, err = netlink.LinkByName(netsetup.TapName(id))
			var notFound netlink.LinkNotFoundError
			assert.True(t, errors.As(err, &notFound), "tap of %s removed, got %v", id, err)
		}
	})
}
