package imagecache

import (
	"encoding"
	"io"
	"sync"
	"sync/atomic"
)

// The download pipeline: one goroutine reads the body, one hashes, and the
// caller's writes the file, so at full speed the hash (the costliest stage,
// and the one no other core can share) runs without pause while the next
// buffer arrives and the last one is written. Each buffer goes to the hasher
// and the writer at once, never copied, and back to the reader once both are
// done with it.
const (
	pipeBufSize = 1 << 20
	// pipeDepth buffers per download: enough for the reader to stay ahead
	// through a checkpoint's fsync, little enough that a handful of
	// downloads at once cost tens of MiB.
	pipeDepth = 8
)

// pipeBufs keeps buffers between downloads; a download holds pipeDepth of
// them for its life.
var pipeBufs = sync.Pool{New: func() any { b := make([]byte, pipeBufSize); return &b }}

// chunk is one buffer's worth of the body on its way through the pipeline.
type chunk struct {
	buf *[]byte
	n   int   // bytes of *buf filled
	err error // how the read ended after these bytes (io.EOF at the end)
	// refs counts the stages (hasher, writer) still using buf.
	refs atomic.Int32

	// A checkpoint falls after this chunk: the hasher leaves its state
	// there (state, stateErr) and then closes hashed.
	mark     bool
	hashed   chan struct{}
	state    []byte
	stateErr error
}

// pump moves body into p: the file, the hash and the counts. It returns the
// read's error (nil at EOF), or a *localError if writing or checkpointing
// failed, in which case p is broken. abort must unblock a pending
// body.Read; it is called when the writer fails, so the reader can be
// waited for rather than left running. progress, if not nil, hears of
// every chunk written. When pump returns, no goroutine of it is running and
// the hash is over exactly p's bytes (unless p is broken).
func (p *partial) pump(body io.Reader, abort func(), progress io.Writer) error {
	bufs := make([]*[]byte, pipeDepth)
	free := make(chan *[]byte, pipeDepth)
	for i := range bufs {
		bufs[i] = pipeBufs.Get().(*[]byte)
		free <- bufs[i]
	}
	// A chunk holds a buffer, so neither queue ever holds more than
	// pipeDepth and no send on them blocks.
	toHash := make(chan *chunk, pipeDepth)
	toWrite := make(chan *chunk, pipeDepth)
	stop := make(chan struct{})
	release := func(c *chunk) {
		if c.refs.Add(-1) == 0 {
			free <- c.buf
		}
	}

	unsynced := p.unsynced // the reader's count from here; the writer's is p's
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // reader
		defer wg.Done()
		defer close(toWrite)
		defer close(toHash)
		for {
			var buf *[]byte
			select {
			case buf = <-free:
			case <-stop:
				return
			}
			n, err := fillHalf(body, *buf)
			c := &chunk{buf: buf, n: n, err: err}
			c.refs.Store(2)
			unsynced += int64(n)
			if unsynced >= p.every && err == nil {
				c.mark, c.hashed = true, make(chan struct{})
				unsynced = 0
			}
			toHash <- c
			toWrite <- c
			if err != nil {
				return
			}
		}
	}()
	go func() { // hasher
		defer wg.Done()
		stopped := false
		for c := range toHash {
			if !stopped {
				select {
				case <-stop:
					stopped = true // the writer failed: p is discarded
				default:
				}
			}
			if !stopped {
				p.h.Write((*c.buf)[:c.n])
			}
			if c.mark {
				if !stopped {
					c.state, c.stateErr = p.h.(encoding.BinaryMarshaler).MarshalBinary()
				}
				close(c.hashed)
			}
			release(c)
		}
	}()
	defer func() {
		wg.Wait()
		for _, b := range bufs {
			pipeBufs.Put(b)
		}
	}()

	// A checkpoint's fsync runs beside the writer, which goes on past it:
	// the record says only that the bytes up to the mark are on disk, and
	// those written after it are synced too, or are cut off on a resume.
	// One at a time, and never waited for: a mark that comes while the last
	// checkpoint is still syncing is held (a newer one replaces it) and
	// starts once that sync ends. Waiting instead stalled the writer for the
	// length of a sync at every mark, and with it the whole pipeline.
	var syncing chan error
	// settle collects the running checkpoint's result, waiting for it if
	// wait; without wait, done is false while it still runs.
	settle := func(wait bool) (done bool, err error) {
		if syncing == nil {
			return true, nil
		}
		if wait {
			err = <-syncing
		} else {
			select {
			case err = <-syncing:
			default:
				return false, nil
			}
		}
		syncing = nil
		return true, err
	}
	var held *chunk // the latest mark not yet checkpointed
	var heldN int64 // p.n just after held was written
	fail := func(err error) error {
		p.broken = true
		close(stop)
		abort()
		settle(true)
		return &localError{err}
	}
	checkpoint := func() error {
		<-held.hashed // the hasher is never stopped while the writer runs
		if held.stateErr != nil {
			return held.stateErr
		}
		// Extended here, not beside the writer: a truncate racing a
		// write past it would cut that write off.
		if err := p.extend(); err != nil {
			return err
		}
		rec, n, state := p.rec, heldN, held.state
		held = nil
		done := make(chan error, 1)
		syncing = done
		go func() { done <- p.record(rec, n, state) }()
		p.unsynced = p.n - n
		return nil
	}
	for c := range toWrite {
		if c.n > 0 {
			if err := p.write((*c.buf)[:c.n]); err != nil {
				return fail(err)
			}
			if progress != nil {
				progress.Write((*c.buf)[:c.n])
			}
		}
		if c.mark {
			held, heldN = c, p.n
		}
		if held != nil {
			ok, err := settle(false)
			if err != nil {
				return fail(err)
			}
			if ok {
				if err := checkpoint(); err != nil {
					return fail(err)
				}
			}
		}
		release(c)
		if c.err != nil {
			if _, err := settle(true); err != nil {
				return fail(err)
			}
			if err := p.extend(); err != nil {
				return fail(err)
			}
			if c.err == io.EOF {
				return nil
			}
			return c.err
		}
	}
	return nil // not reached: the reader's last chunk carries an error
}

// fillHalf reads into buf until at least half of it is full or the read
// fails: a lone short read would hand a mostly empty buffer down the
// pipeline, and every hop costs a hash call, a write and a wake-up.
func fillHalf(r io.Reader, buf []byte) (int, error) {
	n := 0
	var err error
	for n < len(buf)/2 && err == nil {
		var m int
		m, err = r.Read(buf[n:])
		n += m
	}
	return n, err
}
