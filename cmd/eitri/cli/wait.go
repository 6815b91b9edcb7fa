package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"
	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"

	eitriv1 "github.com/a73x/eitri/gen/go/eitri/v1"
	"github.com/a73x/eitri/wire/vmstate"
)

// waitFor follows the VM with this id over WatchVMs until it settles,
// narrating it, and returns it settled: ready or stopped, or the error it
// failed with. timeout 0 waits as long as it takes.
func (c *client) waitFor(ctx context.Context, id string, timeout time.Duration) (*eitriv1.VM, error) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	// Under -o json|yaml stdout carries the settled VM alone; the narration
	// goes to stderr.
	w, tty := c.out, c.tty
	if c.format != formatTable {
		w, tty = c.errOut, isTerminal(c.errOut)
	}
	n := newNarrator(w, tty)
	defer n.stop()
	st, err := c.vm.WatchVMs(ctx, connect.NewRequest(&eitriv1.WatchVMsRequest{}))
	if err != nil {
		return nil, apiError(err)
	}
	defer st.Close()
	for st.Receive() {
		m := st.Msg()
		var v *eitriv1.VM
		switch {
		case m.GetSnapshot() != nil:
			for _, x := range m.GetSnapshot().GetVms() {
				if x.Id == id {
					v = x
				}
			}
			if v == nil {
				return nil, fmt.Errorf("VM %s is gone", id)
			}
		case m.GetChanged().GetId() == id:
			v = m.GetChanged()
		case m.GetRemovedId() == id:
			return nil, fmt.Errorf("VM %s was removed", id)
		default:
			continue
		}
		if settled, err := n.see(v); settled {
			return v, err
		}
	}
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return nil, fmt.Errorf("gave up waiting after %s; the VM carries on (eitri vm wait %s)", timeout, id)
	case ctx.Err() != nil:
		return nil, fmt.Errorf("stopped waiting; the VM carries on (eitri vm wait %s)", id)
	case st.Err() != nil:
		return nil, apiError(st.Err())
	}
	return nil, fmt.Errorf("the control plane ended the watch; eitri vm wait %s goes on waiting", id)
}

// settled says whether a VM has come to rest, and the error when it came
// to rest broken. The lifecycle says where a VM is going as soon as it is
// asked to, so a VM just started reads "starting", never its old "stopped".
func settled(v *eitriv1.VM) (bool, error) {
	switch v.Lifecycle {
	case vmstate.LifecycleReady, vmstate.LifecycleStopped:
		return true, nil
	case vmstate.LifecycleFailed:
		return true, fmt.Errorf("%s failed: %s", v.Name, v.LastError)
	case vmstate.LifecycleLost:
		return true, fmt.Errorf("%s is lost: %s", v.Name, v.LastError)
	case vmstate.LifecycleDeleting:
		return true, fmt.Errorf("%s is being deleted", v.Name)
	}
	return false, nil
}

// narrator tells a person what a VM is doing, from the VMs WatchVMs
// pushes: a line per step (a new lifecycle or a new sentence from the
// host), and a meter for a step the host measures, drawn from
// VM.progress — never from the sentence.
type narrator struct {
	w     io.Writer
	meter meter
	now   func() time.Time
	// What the last VM seen said.
	lifecycle, detail string
	// measuring: a meter is running for this step.
	measuring bool
	step      string
}

// meter shows one measured step: a bar on a terminal, lines elsewhere.
type meter interface {
	begin(step string, at time.Time)
	set(done uint64, total *uint64, at time.Time)
	// end stops the meter; complete says the step finished (rather than
	// the VM failing or the wait ending in the middle of it).
	end(complete bool)
}

func newNarrator(w io.Writer, tty bool) *narrator {
	var m meter = &lineMeter{w: w}
	if tty {
		m = &barMeter{w: w}
	}
	return &narrator{w: w, meter: m, now: time.Now}
}

// see takes the VM's latest state and says whether it has settled (with
// the error it failed with).
func (n *narrator) see(v *eitriv1.VM) (bool, error) {
	at := n.now()
	p := v.GetProgress()
	measured := p != nil && vmstate.Narrated(v.Lifecycle)
	moved := v.Lifecycle != n.lifecycle
	// The same measured step again is the meter moving, not a new line,
	// whatever the sentence says.
	same := n.measuring && measured && !moved && p.GetStep() == n.step
	if n.measuring && !same {
		n.meter.end(v.Lifecycle != vmstate.LifecycleFailed && v.Lifecycle != vmstate.LifecycleLost && v.Lifecycle != vmstate.LifecycleDeleting)
		n.measuring = false
	}
	if !same && (moved || v.StatusDetail != n.detail) {
		n.line(at, v)
	}
	if measured {
		if !same {
			n.meter.begin(p.GetStep(), at)
			n.measuring, n.step = true, p.GetStep()
		}
		n.meter.set(p.GetDoneBytes(), optional(p.TotalBytes), at)
	}
	n.lifecycle, n.detail = v.Lifecycle, v.StatusDetail
	return settled(v)
}

// stop ends a meter still running (the wait ended mid-step).
func (n *narrator) stop() {
	if n.measuring {
		n.meter.end(false)
		n.measuring = false
	}
}

// line is one step: the lifecycle, and what the host says it is doing; a
// ready VM's address. A failure's error is the command's own error, so it
// is not said twice.
func (n *narrator) line(at time.Time, v *eitriv1.VM) {
	s := v.Lifecycle
	switch {
	case v.Lifecycle == vmstate.LifecycleReady && v.AssignedIp != "":
		s += " at " + v.AssignedIp
	case vmstate.Narrated(v.Lifecycle) && v.StatusDetail != "":
		s += ": " + v.StatusDetail
	}
	fmt.Fprintf(n.w, "%s %s\n", at.Format(time.TimeOnly), s)
}

func optional(p *uint64) *uint64 {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}

// size words bytes as the bar does ("72.0 MiB").
func size(n uint64) string {
	if n < 1024 {
		return fmt.Sprintf("%d B", n)
	}
	return fmt.Sprintf("% .1f", decor.SizeB1024(int64(n)))
}

// barMeter draws a step as a progress bar in place: bytes done of the
// total, percentage, rate and time left; an unknown total shows a spinner
// with the bytes so far and the rate.
type barMeter struct {
	w io.Writer
	// opts are extra container options (tests refresh by hand and set a
	// width).
	opts []mpb.ContainerOption

	p     *mpb.Progress
	bar   *mpb.Bar
	step  string
	total *uint64 // once known
	last  time.Time
}

func (b *barMeter) begin(step string, at time.Time) {
	b.p = mpb.New(append([]mpb.ContainerOption{mpb.WithOutput(b.w)}, b.opts...)...)
	b.bar, b.step, b.total, b.last = nil, step, nil, at
}

func (b *barMeter) set(done uint64, total *uint64, at time.Time) {
	switch {
	case b.bar == nil:
		b.bar = b.newBar(total)
		// Bytes done before the first sighting say nothing about the rate.
		b.bar.SetCurrent(int64(done))
		b.last = at
		return
	case total != nil && b.total == nil:
		b.bar.SetTotal(int64(*total), false)
		b.total = total
	}
	if d := at.Sub(b.last); d > 0 {
		b.bar.EwmaSetCurrent(int64(done), d)
		b.last = at
	} else {
		b.bar.SetCurrent(int64(done))
	}
}

// ewmaAge is how many updates the rate and time left average over (the
// host reports about once a second).
const ewmaAge = 30

func (b *barMeter) newBar(total *uint64) *mpb.Bar {
	name := decor.Name(b.step + " ")
	speed := decor.EwmaSpeed(decor.SizeB1024(0), "% .1f", ewmaAge)
	if total == nil {
		return b.p.New(0, mpb.SpinnerStyle(), mpb.BarWidth(3),
			mpb.PrependDecorators(name, decor.Current(decor.SizeB1024(0), "% .1f")),
			mpb.AppendDecorators(decor.Name("  "), speed))
	}
	b.total = total
	return b.p.New(int64(*total), mpb.BarStyle(),
		mpb.PrependDecorators(name, decor.Counters(decor.SizeB1024(0), "% .1f / % .1f")),
		mpb.AppendDecorators(decor.Percentage(decor.WC{W: 6}), decor.Name("  "), speed, decor.Name("  ETA "), decor.EwmaETA(decor.ET_STYLE_GO, ewmaAge)))
}

func (b *barMeter) end(complete bool) {
	if b.bar != nil {
		switch {
		case complete && b.total != nil:
			// The step is over: whatever was last reported, it is all done.
			b.bar.SetTotal(int64(*b.total), true)
		case complete:
			b.bar.SetTotal(-1, true)
		default:
			b.bar.Abort(false) // stays drawn where it stopped
		}
	}
	b.p.Wait()
	b.p, b.bar = nil, nil
}

// lineMeter writes a measured step as lines, for logs and pipes: one when
// it is first seen, one per tenth of the total (per 64 MiB when the total
// is unknown), and one when it ends.
type lineMeter struct {
	w io.Writer

	step            string
	startAt, lastAt time.Time
	startDone, done uint64
	total           *uint64
	sawAny          bool
	printedAny      bool
	printedDone     uint64
	next            uint64 // print again once done reaches this
}

const lineEveryUnknown = 64 << 20

func (l *lineMeter) begin(step string, at time.Time) {
	*l = lineMeter{w: l.w, step: step, startAt: at}
}

func (l *lineMeter) set(done uint64, total *uint64, at time.Time) {
	if !l.sawAny {
		l.startDone, l.startAt, l.sawAny = done, at, true
	}
	l.done, l.lastAt = done, at
	if total != nil {
		l.total = total
	}
	if l.printedAny && done < l.next {
		return
	}
	l.print(at)
	l.printedAny, l.printedDone = true, done
	step := uint64(lineEveryUnknown)
	if l.total != nil && *l.total >= 10 {
		step = *l.total / 10
	}
	l.next = (done/step + 1) * step
}

func (l *lineMeter) end(complete bool) {
	if !l.sawAny {
		return
	}
	if complete && l.total != nil {
		l.done = *l.total
	}
	if l.done != l.printedDone {
		l.print(l.lastAt)
	}
}

// print writes "  download 32.0 MiB / 72.0 MiB (44%), 8.0 MiB/s, 5s left":
// the rate is the average since the step was first seen.
func (l *lineMeter) print(at time.Time) {
	s := "  " + l.step + " " + size(l.done)
	if l.total != nil {
		s += " / " + size(*l.total)
		if *l.total > 0 {
			s += fmt.Sprintf(" (%d%%)", l.done*100 / *l.total)
		}
	}
	if el := l.lastAt.Sub(l.startAt); el > 0 && l.done > l.startDone {
		rate := float64(l.done-l.startDone) / el.Seconds()
		s += ", " + size(uint64(rate)) + "/s"
		if l.total != nil && *l.total > l.done {
			left := time.Duration(float64(*l.total-l.done) / rate * float64(time.Second))
			s += ", " + left.Round(time.Second).String() + " left"
		}
	}
	fmt.Fprintf(l.w, "%s %s\n", at.Format(time.TimeOnly), s)
}
