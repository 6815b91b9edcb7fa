package imagecache

import (
	"bytes"
	"encoding/binary"
	"testing"

	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/zstd"
	"github.com/stretchr/testify/require"
)

// encOpts shapes a qcow2 made by the test encoder below, so the decoder is
// exercised without qemu-img and on layouts qemu-img would not produce.
type encOpts struct {
	version     uint32 // 2 or 3
	clusterBits uint32
	compress    string // "", "zlib" or "zstd"
	zeroFlag    bool   // v3: all-zero clusters get the zero flag (with a bogus offset) instead of being unallocated
	backing     string // sets a backing file name
	crypt       uint32
	corruptData bool // compressed streams are garbled
	// trimTail drops this many bytes off the end of the file, leaving the
	// last compressed stream shorter than its sector count says.
	trimTail int
}

// encodeQcow2 writes raw as a qcow2 image. Layout: header cluster, refcount
// table, one refcount block, the L1 table, the L2 tables, then data, with
// compressed streams packed back to back at byte granularity the way QEMU
// packs them.
func encodeQcow2(t testing.TB, raw []byte, o encOpts) []byte {
	t.Helper()
	if o.version == 0 {
		o.version = 3
	}
	if o.clusterBits == 0 {
		o.clusterBits = 16
	}
	cs := int64(1) << o.clusterBits
	l2Entries := cs / 8
	vsize := int64(len(raw))
	nClusters := (vsize + cs - 1) / cs
	l1Size := (nClusters + l2Entries - 1) / l2Entries

	cluster := func(i int64) []byte {
		c := make([]byte, cs)
		copy(c, raw[min(i*cs, vsize):min((i+1)*cs, vsize)])
		return c
	}
	isZeroCluster := func(i int64) bool { return bytes.Count(cluster(i), []byte{0}) == int(cs) }

	// Which L2 tables exist.
	l2Index := map[int64]int64{} // l1 index -> ordinal
	for i := range nClusters {
		if !isZeroCluster(i) || o.zeroFlag {
			if _, ok := l2Index[i/l2Entries]; !ok {
				l2Index[i/l2Entries] = int64(len(l2Index))
			}
		}
	}
	l1Clusters := max(1, (l1Size*8+cs-1)/cs)
	l1Off := 3 * cs
	l2Base := l1Off + l1Clusters*cs
	dataOff := l2Base + int64(len(l2Index))*cs

	file := make([]byte, dataOff)
	be := binary.BigEndian
	var data bytes.Buffer
	l1 := file[l1Off:]
	for i := range nClusters {
		ord, ok := l2Index[i/l2Entries]
		if !ok {
			continue
		}
		l2Off := l2Base + ord*cs
		be.PutUint64(l1[(i/l2Entries)*8:], uint64(l2Off)|1<<63)
		slot := file[l2Off+(i%l2Entries)*8:]
		c := cluster(i)
		switch {
		case isZeroCluster(i) && o.zeroFlag:
			// The zero flag wins over any offset; point at the header to
			// prove the decoder does not read it.
			be.PutUint64(slot, l2ZeroFlag|uint64(cs))
		case isZeroCluster(i):
			// unallocated
		case o.compress != "":
			var z []byte
			if o.compress == "zlib" {
				var b bytes.Buffer
				w, err := flate.NewWriter(&b, flate.BestSpeed)
				require.NoError(t, err)
				_, _ = w.Write(c)
				require.NoError(t, w.Close())
				z = b.Bytes()
			} else {
				e, err := zstd.NewWriter(nil, zstd.WithEncoderConcurrency(1))
				require.NoError(t, err)
				z = e.EncodeAll(c, nil)
			}
			if o.corruptData {
				for k := range z {
					z[k] ^= 0x5a
				}
			}
			host := dataOff + int64(data.Len())
			data.Write(z)
			x := 62 - (o.clusterBits - 8)
			sectors := (host+int64(len(z))-1)/512 - host/512
			be.PutUint64(slot, l2Compressed|uint64(sectors)<<x|uint64(host))
		default:
			// Uncompressed clusters sit on cluster boundaries.
			if pad := (dataOff + int64(data.Len())) % cs; pad != 0 {
				data.Write(make([]byte, cs-pad))
			}
			host := dataOff + int64(data.Len())
			data.Write(c)
			be.PutUint64(slot, uint64(host)|1<<63)
		}
	}
	file = append(file, data.Bytes()...)
	if pad := int64(len(file)) % 512; pad != 0 {
		file = append(file, make([]byte, 512-pad)...)
	}

	// Refcount table -> one block; 16-bit refcounts of 1 for every cluster
	// the file holds (as many as one block covers; the decoder ignores them).
	be.PutUint64(file[cs:], uint64(2*cs))
	total := (int64(len(file)) + cs - 1) / cs
	for i := int64(0); i < min(total, cs/2); i++ {
		be.PutUint16(file[2*cs+i*2:], 1)
	}

	h := file[:cs]
	copy(h, qcow2Magic)
	be.PutUint32(h[4:], o.version)
	be.PutUint32(h[20:], o.clusterBits)
	be.PutUint64(h[24:], uint64(vsize))
	be.PutUint32(h[32:], o.crypt)
	be.PutUint32(h[36:], uint32(l1Size))
	be.PutUint64(h[40:], uint64(l1Off))
	be.PutUint64(h[48:], uint64(cs))
	be.PutUint32(h[56:], 1)
	extOff := int64(qcowHeaderV2Len)
	if o.version >= 3 {
		be.PutUint32(h[96:], 4) // refcount_order: 16-bit
		hl := uint32(qcowHeaderV3Len)
		if o.compress == "zstd" {
			be.PutUint64(h[72:], incompatCompression)
			hl = 112 // padded to 8
			h[104] = compressionZstd
		}
		be.PutUint32(h[100:], hl)
		extOff = int64(hl)
	}
	// End-of-extensions marker is the zero bytes already there; the backing
	// name goes after it.
	if o.backing != "" {
		nameOff := extOff + 64
		copy(h[nameOff:], o.backing)
		be.PutUint64(h[8:], uint64(nameOff))
		be.PutUint32(h[16:], uint32(len(o.backing)))
	}
	if o.trimTail > 0 {
		file = file[:len(file)-o.trimTail]
	}
	return file
}
