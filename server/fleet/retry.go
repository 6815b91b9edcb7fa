package fleet

import (
	"context"
	"fmt"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/auth"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/wire/vmstate"
)

// RetryVM gives a failed VM a fresh budget: its retry counter rises, and a
// host that sees it higher than the one its failure answers to starts over
// at once (the create, or the restarts after the guest kept exiting).
//
// The row reads "pending" again from now on, so the VM holds its share of
// quota and host capacity from the request on, as a restore does; a failed
// report the host sent before it saw the retry does not undo that (see
// persistRow). Asking again while a retry is on its way is the same request.
func (f *Fleet) RetryVM(ctx context.Context, id string) (*eitriv1.VM, error) {
	cur, _, err := f.visible(ctx, id)
	if err != nil {
		return nil, err
	}
	switch err := f.retryable(cur); {
	case err != nil:
		return nil, err
	case f.lifecycle(cur) == vmstate.LifecycleRetrying:
		return f.vmView(cur), nil
	}
	f.quota.admit.Lock()
	defer f.quota.admit.Unlock()
	owner, err := f.st.UserByID(ctx, cur.OwnerID)
	if err != nil {
		return nil, err
	}
	// A failed VM holds nothing (vmHolds); retried, it holds its size again.
	want := cur
	want.Status = vmstate.LifecyclePending
	c, m, d := vmHolds(want)
	if err := f.admitQuota(ctx, f.st, auth.Principal{UserID: owner.ID, Name: owner.Name}, Usage{VCPUs: c, MemMB: m, DiskGB: d}); err != nil {
		return nil, err
	}
	if _, why := f.room(ctx, f.st, cur.HostID, c, m, d); why != "" {
		where := cur.HostID
		if h, err := f.st.HostByID(ctx, cur.HostID); err == nil {
			where = h.Name
		}
		return nil, errorf(Precondition, "cannot retry vm %s: its host %s %s", id, where, why)
	}
	var lastErr string
	vm, changed, err := f.st.UpdateVM(ctx, id, func(v *store.VM) error {
		if err := f.retryable(*v); err != nil {
			return err
		}
		lastErr = v.LastError
		v.Retry++
		v.Status = vmstate.LifecyclePending
		return nil
	})
	if err != nil {
		return nil, storeErr(err, "vm "+id)
	}
	if changed {
		msg := "retry requested"
		if lastErr != "" {
			msg = fmt.Sprintf("retry requested after: %s", lastErr)
		}
		f.event(ctx, id, "retried", msg)
		f.vmWritten(vm)
	}
	return f.vmView(vm), nil
}

// retryable refuses a retry of a VM that is not failed.
func (f *Fleet) retryable(v store.VM) error {
	switch lc := f.lifecycle(v); {
	case v.DeletedAt != nil:
		return errorf(Precondition, "vm %s is deleted; restore it first", v.ID)
	case v.Status == vmstate.LifecycleLost:
		return errorf(Precondition, "vm %s is lost: %s", v.ID, v.LastError)
	case lc == vmstate.LifecycleFailed, lc == vmstate.LifecycleRetrying:
		return nil
	default:
		return errorf(Precondition, "vm %s is %s, not failed; only a failed VM can be retried", v.ID, lc)
	}
}

// lifecycle is the VM's lifecycle as the API shows it now.
func (f *Fleet) lifecycle(v store.VM) string {
	row, reporting := f.reg.VM(v.HostID, v.ID)
	return Lifecycle(v, row, reporting)
}
