package superfluid

/*
#include <stdlib.h>
#include "superfluid.h"
*/
import "C"

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

const (
	spinNs  = 200_000 // a peer's turnaround (the header's wire rules)
	pollGap = 5 * time.Millisecond
)

// Conn is a planner's view of one worker: plans out, events in, ops, rings.
// One Conn per worker and not for concurrent use: its queues have one
// producer and one consumer.
type Conn struct {
	Path    string
	Epoch   uint64 // the worker's, as of the last (re)connect
	Session uint64 // stamped on every plan and op

	smap C.SegmentMap // sf_segment_open's: the mapping and the locked fd
	mem  []byte       // the mapping, as bytes
	seg  *C.SegmentHeader
	v    *views

	nextSeq, nextOp, nextTag uint64
	ready                    []*Events
	completions              map[uint64]*Completion
	inflight                 map[uint64]bool // plan_seqs sent to this epoch, not yet answered
	stale                    map[uint64]bool // plan_seqs sent to an earlier epoch
	orphans                  map[uint64]bool // lanes a stale plan admitted on the new worker
	early                    []any           // a newer epoch's messages, read before Reconnect
	desc                     *Describe
	spins                    map[*C.QueueView]*spinBudget // each queue's waits, as its recent waits say

	QueueResets   []QueueReset // the worker found a queue corrupted and reset it
	Dropped       int          // event-queue messages that did not decode
	OtherSessions int          // replies to other sessions' plans and ops, dropped
}

// SegmentPath is where worker index of daemon name lives (the sessions comment, step 1).
func SegmentPath(name string, index int) string {
	dir := os.Getenv("SUPERFLUID_SHM_DIR")
	if dir == "" {
		dir = "/dev/shm"
	}
	return filepath.Join(dir, "superfluid."+name+"."+strconv.Itoa(index))
}

// Connect opens worker index of daemon name, checks it, takes it, waits
// until it is READY and begins a session (abi/superfluid.h, "sessions").
// The segment may not exist yet: a planner may start before its daemon.
func Connect(name string, index int, timeout time.Duration) (*Conn, error) {
	deadline := time.Now().Add(timeout)
	c, err := open(name, index, timeout)
	if err != nil {
		return nil, err
	}
	if err = c.begin(deadline); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// open: steps 1-3, find and check (sf_segment_open, which waits up to
// timeout while the daemon is still making the segment), take.
func open(name string, index int, timeout time.Duration) (*Conn, error) {
	path := SegmentPath(name, index)
	if index < 0 || index > 0xFFFF {
		return nil, &SegmentError{Path: path, Code: SF_CONNECT_NAME}
	}
	if timeout < 0 {
		timeout = 0 // one try (a C timeout below 0 would mean none)
	}
	cname := C.CString(name)
	defer C.free(unsafe.Pointer(cname))
	c := &Conn{Path: path, v: newViews()}
	switch r := int(C.sf_segment_open(cname, C.uint32_t(index), C.int64_t(timeout.Nanoseconds()), &c.smap)); {
	case r < 0:
		c.v.free()
		return nil, &SegmentError{Path: path, Code: -1, Msg: syscall.Errno(-r).Error()}
	case r != SF_CONNECT_OK:
		c.v.free()
		return nil, &SegmentError{Path: path, Code: r}
	}
	c.seg = c.smap.seg
	c.mem = unsafe.Slice((*byte)(unsafe.Pointer(c.smap.seg)), int(c.smap.bytes))
	switch r := int(C.sf_session_lock(c.smap.fd)); {
	case r == -SF_EWOULDBLOCK:
		c.Close()
		return nil, fmt.Errorf("%s: %w", path, ErrTaken)
	case r != 0:
		c.Close()
		return nil, &SegmentError{Path: path, Code: -1, Msg: "lock: " + syscall.Errno(-r).Error()}
	}
	if err := c.attach(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func (c *Conn) attach() error {
	l := c.seg.layout
	n := uint64(len(c.mem))
	at := func(off C.uint64_t) (unsafe.Pointer, C.uint64_t) {
		if uint64(off) >= n {
			return unsafe.Pointer(&c.mem[0]), 0
		}
		return unsafe.Pointer(&c.mem[off]), C.uint64_t(n - uint64(off))
	}
	bad := false
	q := func(v *C.QueueView, off C.uint64_t) {
		p, size := at(off)
		bad = bad || C.sf_queue_attach(v, p, size) != 0
	}
	r := func(v *C.RingView, off C.uint64_t) {
		p, size := at(off)
		bad = bad || C.sf_ring_attach(v, p, size) != 0
	}
	q(c.v.plans, l.plan_queue)
	q(c.v.events, l.event_queue)
	q(c.v.ops, l.op_queue)
	q(c.v.stream, l.stream_queue)
	r(c.v.prompt, l.prompt_ring)
	r(c.v.tokens, l.token_ring)
	r(c.v.logits, l.logits_ring)
	if bad {
		return &SegmentError{Path: c.Path, Code: -1, Msg: "a queue or ring does not fit the segment"}
	}
	return nil
}

// begin: steps 4-5, wait for READY, start a session.
func (c *Conn) begin(deadline time.Time) error {
	epoch, err := c.waitReady(0, deadline)
	if err != nil {
		return err
	}
	c.Epoch = epoch
	c.Session = uint64(C.sf_session_begin(c.seg))
	c.nextSeq, c.nextOp = 1, 1
	// Apart from every earlier session's lane tags (their lanes may still be live).
	c.nextTag = (c.Session&0xFFFFFFFF)<<32 + 1
	c.completions = map[uint64]*Completion{}
	c.inflight, c.stale, c.orphans = map[uint64]bool{}, map[uint64]bool{}, map[uint64]bool{}
	c.drainStale()
	return nil
}

func (c *Conn) waitReady(after uint64, deadline time.Time) (uint64, error) {
	var epoch C.uint64_t
	left := time.Until(deadline)
	if left < 0 {
		left = 0
	}
	switch C.sf_wait_ready(c.seg, C.uint64_t(after), C.int64_t(left.Nanoseconds()), &epoch) {
	case SF_WAIT_READY:
		return uint64(epoch), nil
	case SF_WAIT_TIMEOUT:
		return 0, &TimeoutError{fmt.Sprintf("a READY worker (epoch %d, state %s)", c.segEpoch(),
			WorkerStateName(c.state()))}
	}
	st := c.state()
	return 0, &DaemonGoneError{Path: c.Path, State: st, GaveUp: st == SF_WORKER_GAVE_UP}
}

// Reconnect, after ErrWorkerGone: wait for the next READY worker and talk
// to it in the same session. What the old one had (lanes, rows, leases,
// handles) is gone; plan_seq keeps counting. Returns the new epoch.
func (c *Conn) Reconnect(timeout time.Duration) (uint64, error) {
	epoch, err := c.waitReady(c.Epoch, time.Now().Add(timeout))
	if err != nil {
		return 0, err
	}
	c.Epoch = epoch
	c.desc = nil
	// Plans still queued may reach the new worker: their events must not
	// pass for answers to new plans.
	for s := range c.inflight {
		c.stale[s] = true
	}
	c.inflight = map[uint64]bool{}
	c.ready = nil
	c.orphans = map[uint64]bool{}
	early := c.early
	c.early = nil
	for _, m := range early {
		c.fileMsg(m)
	}
	c.drainStale()
	return epoch, nil
}

// Close ends the session: the lock goes, another planner may connect.
func (c *Conn) Close() error {
	if c.seg == nil {
		return nil
	}
	C.sf_session_unlock(c.smap.fd)
	C.sf_segment_close(&c.smap)
	c.mem, c.seg = nil, nil
	c.v.free()
	return nil
}

func (c *Conn) segEpoch() uint64 {
	return uint64(C.sf_load_acquire_u64((*C.uint64_t)(unsafe.Pointer(&c.seg.worker_epoch))))
}

func (c *Conn) state() uint32 {
	return uint32(C.sf_load_acquire_u32((*C.uint32_t)(unsafe.Pointer(&c.seg.worker_state))))
}

// WorkerPID is the worker process serving now (the header's report).
func (c *Conn) WorkerPID() int {
	return int(C.sf_load_acquire_u32((*C.uint32_t)(unsafe.Pointer(&c.seg.worker_pid))))
}

// Runtime is the runtime description the worker wrote when it became ready.
func (c *Conn) Runtime() RuntimeDesc { return *(*RuntimeDesc)(unsafe.Pointer(&c.seg.runtime)) }

// SetYield and SetLatencyWanted are the planner's two header words (contract §4).
func (c *Conn) SetYield(on bool) {
	C.sf_store_release_u32((*C.uint32_t)(unsafe.Pointer(&c.seg.yield_requested)), b32(on))
}

func (c *Conn) SetLatencyWanted(on bool) {
	C.sf_store_release_u32((*C.uint32_t)(unsafe.Pointer(&c.seg.latency_wanted)), b32(on))
}

func b32(on bool) C.uint32_t {
	if on {
		return 1
	}
	return 0
}

func goneState(s uint32) bool {
	return s == SF_WORKER_STOPPED || s == SF_WORKER_DEAD || s == SF_WORKER_GAVE_UP
}

func (c *Conn) gone(epoch uint64, n *WorkerNotice) error {
	e := &WorkerGoneError{Epoch: c.segEpoch(), OldEpoch: c.Epoch, State: c.state(), Notice: n}
	if epoch > e.Epoch {
		e.Epoch = epoch
	}
	if n != nil {
		e.State = n.WorkerState
		if n.WorkerEpoch > e.Epoch {
			e.Epoch = n.WorkerEpoch
		}
	}
	return e
}

// CheckWorker is ErrWorkerGone if the worker of this epoch no longer serves
// (a cheap look at the header; every wait does it too).
func (c *Conn) CheckWorker() error {
	st := c.state()
	if c.segEpoch() != c.Epoch || goneState(st) {
		return c.gone(0, nil)
	}
	if st == SF_WORKER_READY && !pidAlive(c.WorkerPID()) {
		return c.gone(0, nil)
	}
	return nil
}

// pidAlive: a running process (a zombie is dead, waiting to be reaped).
func pidAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	if b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid)); err == nil {
		if i := strings.LastIndexByte(string(b), ')'); i >= 0 && i+2 < len(b) && (b[i+2] == 'Z' || b[i+2] == 'X') {
			return false
		}
	}
	return syscall.Kill(pid, 0) != syscall.ESRCH
}
