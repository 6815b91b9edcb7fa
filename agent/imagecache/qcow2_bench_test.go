package imagecache

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// benchImage is 64 MiB shaped like a disk: a quarter random (incompressible),
// half repetitive text, a quarter zeros.
func benchImage() []byte {
	const size = 64 << 20
	out := make([]byte, 0, size)
	out = append(out, testImage(size / 4 * 3)[:size/4]...) // its first third is random
	out = append(out, bytes.Repeat([]byte("eitri boots a tiny guest; a line of log text\n"), size/2/45)...)
	out = append(out, make([]byte, size-len(out))...)
	return out
}

func BenchmarkDecodeQcow2(b *testing.B) {
	raw := benchImage()
	cases := []struct {
		name string
		make func() []byte
	}{
		{"uncompressed", func() []byte { return encodeQcow2(b, raw, encOpts{}) }},
		{"zlib", func() []byte { return encodeQcow2(b, raw, encOpts{compress: "zlib"}) }},
		{"zstd", func() []byte { return encodeQcow2(b, raw, encOpts{compress: "zstd"}) }},
	}
	if _, err := exec.LookPath("qemu-img"); err == nil {
		// What QEMU itself writes: its streams and packing differ from ours.
		cases = append(cases,
			struct {
				name string
				make func() []byte
			}{"qemu-zlib", func() []byte { return qemuImg(b, raw, "-c") }},
			struct {
				name string
				make func() []byte
			}{"qemu-zstd", func() []byte { return qemuImg(b, raw, "-c", "-o", "compression_type=zstd") }})
	}
	for _, tc := range cases {
		img := tc.make()
		dir := b.TempDir()
		src := filepath.Join(dir, "img.qcow2")
		if err := os.WriteFile(src, img, 0o644); err != nil {
			b.Fatal(err)
		}
		b.Run(tc.name, func(b *testing.B) {
			in, err := os.Open(src)
			if err != nil {
				b.Fatal(err)
			}
			defer in.Close()
			b.SetBytes(int64(len(raw)))
			for b.Loop() {
				out, err := os.Create(filepath.Join(dir, "out.raw"))
				if err != nil {
					b.Fatal(err)
				}
				if err := DecodeQcow2(context.Background(), in, int64(len(img)), out); err != nil {
					b.Fatal(err)
				}
				out.Close()
			}
		})
	}
}
