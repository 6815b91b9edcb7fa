package qemu

import (
	"context"
	"errors"
)

// IOStats is what QEMU counts for one guest: its block devices' traffic
// and, when the guest has a balloon device, the memory the balloon leaves
// it. Counters run since this QEMU started.
type IOStats struct {
	// Disk sums every block device (root disk and seed).
	Disk DiskIO
	// BalloonBytes is the guest's memory as its balloon sees it; nil when
	// the guest has no balloon (the usual case), never 0.
	BalloonBytes *uint64
}

// DiskIO is block traffic: bytes and operations read and written.
type DiskIO struct {
	ReadBytes, WriteBytes, ReadOps, WriteOps uint64
}

// IOStats asks the VM's QEMU for its block statistics (query-blockstats)
// and its balloon (query-balloon) in one QMP session.
func (b *Backend) IOStats(ctx context.Context, id string) (IOStats, error) {
	if err := checkID(id); err != nil {
		return IOStats{}, err
	}
	var out IOStats
	err := b.qmp(ctx, id, func(q *qmpConn) error {
		var err error
		out, err = queryIOStats(q)
		return err
	})
	return out, err
}

func queryIOStats(q *qmpConn) (IOStats, error) {
	var devs []struct {
		Stats struct {
			RdBytes      uint64 `json:"rd_bytes"`
			WrBytes      uint64 `json:"wr_bytes"`
			RdOperations uint64 `json:"rd_operations"`
			WrOperations uint64 `json:"wr_operations"`
		} `json:"stats"`
	}
	if err := q.execute("query-blockstats", nil, &devs); err != nil {
		return IOStats{}, err
	}
	var out IOStats
	for _, d := range devs {
		out.Disk.ReadBytes += d.Stats.RdBytes
		out.Disk.WriteBytes += d.Stats.WrBytes
		out.Disk.ReadOps += d.Stats.RdOperations
		out.Disk.WriteOps += d.Stats.WrOperations
	}
	var balloon struct {
		Actual uint64 `json:"actual"`
	}
	err := q.execute("query-balloon", nil, &balloon)
	var qe *QMPError
	switch {
	case err == nil:
		out.BalloonBytes = &balloon.Actual
	case errors.As(err, &qe):
		// DeviceNotActive: no balloon. Any refusal leaves it unsaid.
	default:
		return IOStats{}, err
	}
	return out, nil
}
