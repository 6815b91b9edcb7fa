package fleet

import (
	"context"
	"fmt"
	"strings"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
)

// maxHostsNamed bounds how many hosts a "no room" error describes, so a
// large fleet cannot make an error of unbounded size.
const maxHostsNamed = 8

// noRoom is the error for a VM no host can take. It says, host by host, what
// holds the capacity (allocated against capacity, and how much of it deleted
// VMs keep until they are destroyed), so a person can tell what to delete or
// resize instead of guessing.
func (f *Fleet) noRoom(ctx context.Context, hosts []store.Host, r *eitriv1.CreateVMRequest) error {
	msg := fmt.Sprintf("no connected host has room for %d vCPU, %d MiB memory and %d GiB disk", r.GetVcpus(), r.GetMemMb(), r.GetDiskGb())
	if len(hosts) == 0 {
		return errorf(Precondition, "%s: no host is enrolled (eitri host join-token adds one)", msg)
	}
	parts := make([]string, 0, min(len(hosts), maxHostsNamed)+1)
	for i, h := range hosts {
		if i == maxHostsNamed {
			parts = append(parts, fmt.Sprintf("and %d more host(s)", len(hosts)-maxHostsNamed))
			break
		}
		parts = append(parts, h.Name+" "+f.holding(ctx, h.ID))
	}
	return errorf(Precondition, "%s: %s", msg, strings.Join(parts, "; "))
}

// holding describes, after a host's name, what is allocated there against
// what it has.
func (f *Fleet) holding(ctx context.Context, hostID string) string {
	live, ok := f.reg.Host(hostID)
	if !ok {
		return "is not connected"
	}
	c := live.Report.GetCapacity()
	if c == nil {
		return "has not reported its capacity yet"
	}
	vms, err := f.st.ListVMsByHost(ctx, hostID)
	if err != nil {
		return "cannot say what it holds (" + err.Error() + ")"
	}
	var vcpus, mem, disk, deletedDisk int64
	var holders, deleted int
	for _, v := range vms {
		cpu, m, d := vmHolds(v)
		if cpu == 0 && m == 0 && d == 0 {
			continue
		}
		vcpus, mem, disk = vcpus+cpu, mem+m, disk+d
		if v.DeletedAt != nil {
			deleted++
			deletedDisk += d
		} else {
			holders++
		}
	}
	s := fmt.Sprintf("has %d/%d vCPU, %d/%d MiB memory, %d/%d GiB disk allocated to %d VM(s)",
		vcpus, c.GetVcpus(), mem, c.GetMemMb(), disk, c.GetDiskGb(), holders)
	if deleted > 0 {
		s += fmt.Sprintf(" and %d deleted VM(s) keeping %d GiB disk until destroyed", deleted, deletedDisk)
	}
	free := [3]int64{max(int64(c.GetVcpus())-vcpus, 0), max(c.GetMemMb()-mem, 0), max(c.GetDiskGb()-disk, 0)}
	return s + fmt.Sprintf(" (free: %d vCPU, %d MiB, %d GiB)", free[0], free[1], free[2])
}
