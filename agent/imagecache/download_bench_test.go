package imagecache

import (
	"context"
	"crypto/sha256"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"testing"
)

// BenchmarkDownload fetches a 64 MiB disk-like image over loopback through
// Ensure: request, body, sha256, the partial file and its checkpoints, and
// placing the raw image durably. Its peer is BenchmarkSHA256, the hash alone
// over the same bytes in memory: a download cannot beat it and should come
// close.
func BenchmarkDownload(b *testing.B) {
	raw := benchImage()
	sha := digest(raw)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", strconv.Itoa(len(raw)))
		w.Write(raw)
	}))
	defer srv.Close()
	dir := b.TempDir()
	b.SetBytes(int64(len(raw)))
	for b.Loop() {
		c := loopbackCache(dir, WithLogger(slog.New(slog.DiscardHandler)))
		if _, err := c.Ensure(context.Background(), srv.URL+"/disk.raw", sha, nil); err != nil {
			b.Fatal(err)
		}
		c.Close()
		b.StopTimer()
		os.RemoveAll(dir)
		b.StartTimer()
	}
}

func BenchmarkSHA256(b *testing.B) {
	raw := benchImage()
	b.SetBytes(int64(len(raw)))
	for b.Loop() {
		sha256.Sum256(raw)
	}
}
