package imagecache

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"

	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/zstd"
	"golang.org/x/sync/errgroup"

	"github.com/a73x/eitri/agent/permanent"
)

// qcow2 on-disk constants (docs/interop/qcow2.txt in QEMU).
const (
	qcowHeaderV2Len = 72
	qcowHeaderV3Len = 104

	incompatDirty       = 1 << 0
	incompatCorrupt     = 1 << 1
	incompatExtDataFile = 1 << 2
	incompatCompression = 1 << 3
	incompatExtendedL2  = 1 << 4

	compressionZlib = 0
	compressionZstd = 1

	l1OffsetMask   = 0x00fffffffffffe00 // bits 9-55
	l2OffsetMask   = 0x00fffffffffffe00 // bits 9-55
	l2Compressed   = 1 << 62
	l2ZeroFlag     = 1 << 0
	l2ReservedBits = 0x3f000000000001fe // bits 1-8 and 56-61 of a standard entry

	// QEMU's own bounds; anything past them is not an image QEMU made.
	maxL1Bytes   = 32 << 20
	maxVirtSize  = 1 << 55
	minClusterSh = 9
	maxClusterSh = 21

	// maxRun bounds how much contiguous uncompressed data one job reads.
	maxRun = 4 << 20
)

// Qcow2Info is what the header says about an image.
type Qcow2Info struct {
	Version         uint32
	ClusterSize     int64
	VirtualSize     int64
	CompressionType uint8 // 0 zlib, 1 zstd
	BackingFile     string
}

type qcow2Header struct {
	Qcow2Info
	clusterBits     uint32
	cryptMethod     uint32
	l1Size          uint32
	l1Offset        uint64
	refcountOffset  uint64
	refcountCluster uint32
	incompatible    uint64
	refcountOrder   uint32
	headerLength    uint32
}

func corruptf(format string, args ...any) error {
	return permanent.Errorf("%w: qcow2: "+format, append([]any{ErrCorrupt}, args...)...)
}

func unsupportedf(format string, args ...any) error {
	return permanent.Errorf("%w: qcow2: "+format, append([]any{ErrUnsupported}, args...)...)
}

// parseQcow2Header reads and checks the header, refusing what this decoder
// cannot turn into a self-contained raw image.
func parseQcow2Header(src io.ReaderAt, size int64) (*qcow2Header, error) {
	buf := make([]byte, qcowHeaderV3Len+8)
	n, err := src.ReadAt(buf, 0)
	if n < qcowHeaderV2Len {
		return nil, corruptf("header truncated (%d bytes): %v", n, err)
	}
	buf = buf[:n]
	be := binary.BigEndian
	if string(buf[:4]) != qcow2Magic {
		return nil, corruptf("bad magic %q", buf[:4])
	}
	h := &qcow2Header{}
	h.Version = be.Uint32(buf[4:])
	backingOff := be.Uint64(buf[8:])
	backingLen := be.Uint32(buf[16:])
	h.clusterBits = be.Uint32(buf[20:])
	vsize := be.Uint64(buf[24:])
	h.cryptMethod = be.Uint32(buf[32:])
	h.l1Size = be.Uint32(buf[36:])
	h.l1Offset = be.Uint64(buf[40:])
	h.refcountOffset = be.Uint64(buf[48:])
	h.refcountCluster = be.Uint32(buf[56:])
	h.refcountOrder = 4
	h.headerLength = qcowHeaderV2Len

	switch h.Version {
	case 2:
	case 3:
		if n < qcowHeaderV3Len {
			return nil, corruptf("v3 header truncated (%d bytes)", n)
		}
		h.incompatible = be.Uint64(buf[72:])
		h.refcountOrder = be.Uint32(buf[96:])
		h.headerLength = be.Uint32(buf[100:])
		if h.headerLength < qcowHeaderV3Len {
			return nil, corruptf("v3 header length %d < %d", h.headerLength, qcowHeaderV3Len)
		}
	default:
		return nil, unsupportedf("version %d (want 2 or 3)", h.Version)
	}

	if h.clusterBits < minClusterSh || h.clusterBits > maxClusterSh {
		return nil, corruptf("cluster_bits %d out of range %d..%d", h.clusterBits, minClusterSh, maxClusterSh)
	}
	h.ClusterSize = 1 << h.clusterBits
	if vsize > maxVirtSize {
		return nil, corruptf("virtual size %d too large", vsize)
	}
	h.VirtualSize = int64(vsize)

	if backingOff != 0 {
		name := "?"
		if backingLen > 0 && backingLen <= 1023 {
			b := make([]byte, backingLen)
			if _, err := src.ReadAt(b, int64(backingOff)); err == nil {
				name = string(b)
			}
		}
		return nil, unsupportedf("image has a backing file %q; flatten it (qemu-img convert) before serving", name)
	}
	if h.cryptMethod != 0 {
		return nil, unsupportedf("image is encrypted (crypt_method %d)", h.cryptMethod)
	}

	inc := h.incompatible
	if inc&incompatCorrupt != 0 {
		return nil, corruptf("image is marked corrupt by QEMU")
	}
	if inc&incompatExtDataFile != 0 {
		return nil, unsupportedf("image keeps its data in an external file")
	}
	if inc&incompatExtendedL2 != 0 {
		return nil, unsupportedf("extended L2 entries (subclusters) are not supported")
	}
	if unknown := inc &^ (incompatDirty | incompatCorrupt | incompatExtDataFile | incompatCompression | incompatExtendedL2); unknown != 0 {
		return nil, unsupportedf("unknown incompatible features %#x", unknown)
	}
	// Dirty only means refcounts may be stale; reading needs none of them.
	if inc&incompatCompression != 0 {
		if h.headerLength <= qcowHeaderV3Len || n <= qcowHeaderV3Len {
			return nil, corruptf("compression type bit set but header has no compression type field")
		}
		h.CompressionType = buf[104]
		if h.CompressionType != compressionZlib && h.CompressionType != compressionZstd {
			return nil, unsupportedf("compression type %d", h.CompressionType)
		}
	}
	if h.Version == 3 && h.refcountOrder > 6 {
		return nil, corruptf("refcount_order %d > 6", h.refcountOrder)
	}

	cmask := uint64(h.ClusterSize - 1)
	if h.l1Offset&cmask != 0 || h.refcountOffset&cmask != 0 {
		return nil, corruptf("table offsets not cluster aligned (l1 %#x, refcount %#x)", h.l1Offset, h.refcountOffset)
	}
	if h.refcountOffset == 0 || h.refcountCluster == 0 || int64(h.refcountOffset) >= size {
		return nil, corruptf("refcount table at %#x (%d clusters) outside a %d-byte file", h.refcountOffset, h.refcountCluster, size)
	}
	l2Entries := uint64(h.ClusterSize / 8)
	need := (vsize + uint64(h.ClusterSize)*l2Entries - 1) / (uint64(h.ClusterSize) * l2Entries)
	if uint64(h.l1Size) < need {
		return nil, corruptf("L1 table has %d entries, virtual size needs %d", h.l1Size, need)
	}
	if uint64(h.l1Size)*8 > maxL1Bytes {
		return nil, corruptf("L1 table of %d entries too large", h.l1Size)
	}
	if h.l1Size > 0 && (h.l1Offset == 0 || int64(h.l1Offset)+int64(h.l1Size)*8 > size) {
		return nil, corruptf("L1 table at %#x (%d entries) outside a %d-byte file", h.l1Offset, h.l1Size, size)
	}
	if err := checkHeaderExtensions(src, h, size); err != nil {
		return nil, err
	}
	return h, nil
}

// checkHeaderExtensions walks the extension list after the header so a
// truncated or looping list is caught; none of them change how data reads
// once backing and external files are refused above.
func checkHeaderExtensions(src io.ReaderAt, h *qcow2Header, size int64) error {
	off := int64(h.headerLength)
	end := min(h.ClusterSize, size)
	var hdr [8]byte
	for off+8 <= end {
		if _, err := src.ReadAt(hdr[:], off); err != nil {
			return corruptf("header extension at %d: %v", off, err)
		}
		typ, ln := binary.BigEndian.Uint32(hdr[:4]), int64(binary.BigEndian.Uint32(hdr[4:]))
		if typ == 0 {
			return nil
		}
		off += 8 + (ln+7)&^7
		if off > end {
			return corruptf("header extension %#x overruns the header cluster", typ)
		}
	}
	return nil
}

// job is one piece of guest data: a run of uncompressed clusters, contiguous
// on the host and in the guest, or one compressed cluster.
type job struct {
	guest      int64
	host       int64
	length     int64 // guest bytes to produce (uncompressed run, or one cluster)
	span       int64 // compressed: host bytes that may hold the stream
	compressed bool
}

// DecodeQcow2 writes the guest-visible contents of the qcow2 image in src
// (srcSize bytes) to dst as a raw image: dst is truncated to the virtual size
// and only non-zero data is written, so unallocated and zero clusters stay
// holes. Decompression runs on up to GOMAXPROCS workers. Every decode failure
// is a permanent error.
func DecodeQcow2(ctx context.Context, src io.ReaderAt, srcSize int64, dst *os.File) error {
	h, err := parseQcow2Header(src, srcSize)
	if err != nil {
		return err
	}
	if err := dst.Truncate(h.VirtualSize); err != nil {
		return fmt.Errorf("image cache: %w", err)
	}
	if h.VirtualSize == 0 {
		return nil
	}

	g, gctx := errgroup.WithContext(ctx)
	jobs := make(chan job, 64)
	g.Go(func() error {
		defer close(jobs)
		return h.plan(gctx, src, srcSize, jobs)
	})
	workers := max(1, min(runtime.GOMAXPROCS(0), 8))
	for range workers {
		g.Go(func() error {
			w, err := newQcowWorker(h, src, srcSize, dst)
			if err != nil {
				return err
			}
			defer w.close()
			for j := range jobs {
				if err := w.do(j); err != nil {
					return err
				}
			}
			return gctx.Err()
		})
	}
	return g.Wait()
}

// plan walks the L1 and L2 tables in guest order and emits the work.
func (h *qcow2Header) plan(ctx context.Context, src io.ReaderAt, srcSize int64, out chan<- job) error {
	cs := h.ClusterSize
	l2Entries := cs / 8
	l1 := make([]byte, int64(h.l1Size)*8)
	if _, err := src.ReadAt(l1, int64(h.l1Offset)); err != nil {
		return corruptf("reading L1 table: %v", err)
	}
	l2 := make([]byte, cs)
	x := 62 - (h.clusterBits - 8) // compressed entry: offset bits below x, sector count above
	offMask := uint64(1)<<x - 1
	var pending *job // run being coalesced

	emit := func(j job) error {
		select {
		case out <- j:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	flush := func() error {
		if pending == nil {
			return nil
		}
		j := *pending
		pending = nil
		return emit(j)
	}

	for i := int64(0); i < int64(h.l1Size); i++ {
		l1Guest := i * l2Entries * cs
		if l1Guest >= h.VirtualSize {
			break
		}
		e := binary.BigEndian.Uint64(l1[i*8:])
		l2Off := int64(e & l1OffsetMask)
		if l2Off == 0 {
			continue // whole L2 range unallocated: a hole
		}
		if l2Off&(cs-1) != 0 || l2Off+cs > srcSize {
			return corruptf("L1[%d]: L2 table at %#x outside the file or unaligned", i, l2Off)
		}
		if _, err := src.ReadAt(l2, l2Off); err != nil {
			return corruptf("reading L2 table at %#x: %v", l2Off, err)
		}
		for k := range l2Entries {
			guest := l1Guest + k*cs
			if guest >= h.VirtualSize {
				break
			}
			length := min(cs, h.VirtualSize-guest)
			le := binary.BigEndian.Uint64(l2[k*8:])
			switch {
			case le&l2Compressed != 0:
				host := int64(le & offMask)
				sectors := int64((le &^ (1 << 63) &^ l2Compressed) >> x)
				span := (host &^ 511) + (sectors+1)*512 - host
				if host == 0 || host >= srcSize {
					return corruptf("compressed cluster for guest %#x at %#x outside the file", guest, host)
				}
				span = min(span, srcSize-host) // the last stream may end at EOF
				if err := flush(); err != nil {
					return err
				}
				if err := emit(job{guest: guest, host: host, length: length, span: span, compressed: true}); err != nil {
					return err
				}
			case h.Version >= 3 && le&l2ZeroFlag != 0:
				// Reads as zeros whatever the offset says: leave the hole.
			default:
				if le&l2ReservedBits != 0 {
					return corruptf("L2 entry for guest %#x has reserved bits set (%#x)", guest, le)
				}
				host := int64(le & l2OffsetMask)
				if host == 0 {
					continue // unallocated: a hole
				}
				if host&(cs-1) != 0 || host >= srcSize {
					return corruptf("data cluster for guest %#x at %#x outside the file or unaligned", guest, host)
				}
				if pending != nil && pending.guest+pending.length == guest &&
					pending.host+pending.length == host && pending.length+length <= maxRun {
					pending.length += length
					continue
				}
				if err := flush(); err != nil {
					return err
				}
				pending = &job{guest: guest, host: host, length: length}
			}
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	return flush()
}

// qcowWorker holds one goroutine's buffers and decompressors, reused across
// clusters: building a decompressor per cluster would dominate the cost.
type qcowWorker struct {
	h       *qcow2Header
	src     io.ReaderAt
	srcSize int64
	dst     *os.File
	buf     []byte // host bytes read
	out     []byte // one decompressed cluster
	br      *bytes.Reader
	fl      io.ReadCloser
	zd      *zstd.Decoder
}

func newQcowWorker(h *qcow2Header, src io.ReaderAt, srcSize int64, dst *os.File) (*qcowWorker, error) {
	w := &qcowWorker{h: h, src: src, srcSize: srcSize, dst: dst,
		buf: make([]byte, max(maxRun, 2*h.ClusterSize)), out: make([]byte, h.ClusterSize),
		br: bytes.NewReader(nil)}
	switch h.CompressionType {
	case compressionZlib:
		w.fl = flate.NewReader(w.br)
	case compressionZstd:
		// Concurrency 1 decodes synchronously in the caller's goroutine; the
		// parallelism is ours, across clusters.
		zd, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(false))
		if err != nil {
			return nil, err
		}
		w.zd = zd
	}
	return w, nil
}

func (w *qcowWorker) close() {
	if w.zd != nil {
		w.zd.Close()
	}
}

func (w *qcowWorker) do(j job) error {
	if !j.compressed {
		b := w.buf[:j.length]
		n, err := w.src.ReadAt(b, j.host)
		if err != nil && !errors.Is(err, io.EOF) {
			return fmt.Errorf("qcow2: reading data at %#x: %w", j.host, err)
		}
		// A file may end inside its last cluster; the rest reads as zeros.
		clear(b[n:])
		return writeSparseAt(w.dst, b, j.guest)
	}

	if j.span > int64(len(w.buf)) {
		return corruptf("compressed cluster for guest %#x spans %d bytes", j.guest, j.span)
	}
	in := w.buf[:j.span]
	n, err := w.src.ReadAt(in, j.host)
	if err != nil && !errors.Is(err, io.EOF) {
		return fmt.Errorf("qcow2: reading compressed cluster at %#x: %w", j.host, err)
	}
	in = in[:n]
	w.br.Reset(in)
	// The stream is followed by padding up to a sector, so read exactly one
	// cluster and ignore what comes after.
	var r io.Reader
	switch w.h.CompressionType {
	case compressionZlib:
		if err := w.fl.(flate.Resetter).Reset(w.br, nil); err != nil {
			return corruptf("cluster for guest %#x: %v", j.guest, err)
		}
		r = w.fl
	default:
		if err := w.zd.Reset(w.br); err != nil {
			return corruptf("cluster for guest %#x: zstd: %v", j.guest, err)
		}
		r = w.zd
	}
	if _, err := io.ReadFull(r, w.out); err != nil {
		name := "zlib"
		if w.h.CompressionType == compressionZstd {
			name = "zstd"
		}
		return corruptf("compressed cluster for guest %#x (host %#x): %s: %v", j.guest, j.host, name, err)
	}
	return writeSparseAt(w.dst, w.out[:j.length], j.guest)
}
