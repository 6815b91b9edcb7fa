package fleet

import (
	"context"
	"sync"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/server/store"
	"github.com/a73x/eitri/server/watch"
)

// published keeps the durable row each VM and exposure was last published
// with. A report that only narrates (status_detail, progress, session
// counters) changes nothing durable, so its event is that row with the new
// live facts: built from memory, with no store read and no transaction, and
// owned by the same user as before, so who may see it is already known.
type published struct {
	mu   sync.Mutex
	vms  map[string]store.VM
	exps map[string]publishedExposure
}

type publishedExposure struct {
	e     store.Exposure
	owner string
}

func (p *published) putVM(vm store.VM) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.vms == nil {
		p.vms = map[string]store.VM{}
	}
	// Two publishes may race from their store reads; the newer row wins.
	if old, ok := p.vms[vm.ID]; ok && old.UpdatedAt.After(vm.UpdatedAt) {
		return
	}
	p.vms[vm.ID] = vm
}

func (p *published) vm(id string) (store.VM, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	vm, ok := p.vms[id]
	return vm, ok
}

// vmsNotIn returns the published VMs whose ids keep lacks.
func (p *published) vmsNotIn(keep map[string]bool) []store.VM {
	p.mu.Lock()
	defer p.mu.Unlock()
	return notIn(p.vms, keep)
}

// exposuresNotIn returns the published exposures whose ids keep lacks.
func (p *published) exposuresNotIn(keep map[string]bool) []publishedExposure {
	p.mu.Lock()
	defer p.mu.Unlock()
	return notIn(p.exps, keep)
}

func notIn[T any](m map[string]T, keep map[string]bool) []T {
	var out []T
	for id, v := range m {
		if !keep[id] {
			out = append(out, v)
		}
	}
	return out
}

func (p *published) dropVM(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.vms, id)
}

func (p *published) putExposure(e store.Exposure, owner string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exps == nil {
		p.exps = map[string]publishedExposure{}
	}
	p.exps[e.ID] = publishedExposure{e, owner}
}

func (p *published) exposure(id string) (publishedExposure, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	e, ok := p.exps[id]
	return e, ok
}

func (p *published) dropExposure(id string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.exps, id)
}

// publishVMRow publishes vm as read or written, with no store read.
func (f *Fleet) publishVMRow(vm store.VM) {
	f.published.putVM(vm)
	f.VMs.Publish(watch.Event[*eitriv1.VM]{ID: vm.ID, Owner: vm.OwnerID, Obj: f.vmView(vm)})
}

// publishLiveVM publishes a VM whose live row changed but whose durable
// facts did not (see registry.Diff.Durable).
func (f *Fleet) publishLiveVM(ctx context.Context, id string) {
	vm, ok := f.published.vm(id)
	if !ok {
		// Never published here: the store's row is all there is to show.
		f.publishVM(ctx, id)
		return
	}
	f.VMs.Publish(watch.Event[*eitriv1.VM]{ID: id, Owner: vm.OwnerID, Obj: f.vmView(vm)})
}

// publishLiveExposure publishes an exposure whose host's word on it
// changed (state, counters); nothing of it is stored.
func (f *Fleet) publishLiveExposure(ctx context.Context, id string) {
	p, ok := f.published.exposure(id)
	if !ok {
		f.publishExposure(ctx, id)
		return
	}
	f.Exposures.Publish(watch.Event[*eitriv1.Exposure]{ID: id, Owner: p.owner, Obj: f.exposureView(ctx, p.e)})
}
