package superfluid

/*
#include "superfluid.h"
*/
import "C"

import (
	"fmt"
	"time"
)

// waitSlot waits for room (write) or a message on q: the slot index, or
// ErrWorkerGone / a *TimeoutError.
func (c *Conn) waitSlot(q *C.QueueView, timeout time.Duration, write bool, what string) (int64, error) {
	if timeout < 0 {
		timeout = 0
	}
	ns := C.int64_t(timeout.Nanoseconds())
	if c.spins == nil {
		c.spins = map[*C.QueueView]*spinBudget{}
	}
	spin := c.spins[q]
	if spin == nil {
		spin = &spinBudget{budgetNs: spinNs}
		c.spins[q] = spin
	}
	start := C.sf_monotonic_ns()
	var i C.int64_t
	if write {
		i = C.sf_queue_wait_reserve(q, c.seg, C.uint64_t(c.Epoch), 0, ns, C.int64_t(spin.spinNs()))
	} else {
		i = C.sf_queue_wait_peek(q, c.seg, C.uint64_t(c.Epoch), 0, ns, C.int64_t(spin.spinNs()))
	}
	spin.waited(int64(C.sf_monotonic_ns() - start))
	switch {
	case i >= 0:
		return int64(i), nil
	case -i == SF_WAIT_TIMEOUT:
		if err := c.CheckWorker(); err != nil {
			return 0, err
		}
		return 0, &TimeoutError{fmt.Sprintf("%s within %v (worker epoch %d)", what, timeout, c.Epoch)}
	}
	return 0, c.gone(0, nil)
}

// A wait counts at most this many budgets towards the typical one, so an idle
// spell is forgotten within a few quick answers.
const longWaitBudgets = 4

// spinBudget is how long a queue's waits spin before they sleep, from how
// long its recent waits took (the header's wait advice; the Python client's
// SpinBudget): the whole budget while they typically end within about twice
// it, none once they typically do not. A wait spun through a long tick
// (milliseconds) is a core taken from the worker's threads on a small
// machine; a short one (an empty tick) is answered while spinning.
type spinBudget struct {
	budgetNs  int64
	typicalNs int64 // a running mean (1/8 per wait) of recent waits, each capped
}

func (s *spinBudget) spinNs() int64 {
	if s.typicalNs <= 2*s.budgetNs {
		return s.budgetNs
	}
	return 0
}

func (s *spinBudget) waited(ns int64) {
	if ns < 0 {
		ns = 0
	}
	if max := longWaitBudgets * s.budgetNs; ns > max {
		ns = max
	}
	s.typicalNs += (ns - s.typicalNs) >> 3
}

// NextPlanSeq is the plan_seq the next plan gets when it has none.
func (c *Conn) NextPlanSeq() uint64 { return c.nextSeq }

// NewLaneTag is a lane tag this connection never handed out (tags are never
// reused, so a stale plan's lane can't be mistaken for a new one).
func (c *Conn) NewLaneTag() uint64 {
	t := c.nextTag
	c.nextTag++
	return t
}

// Submit queues a plan, waiting while the plan queue is full; its plan_seq.
func (c *Conn) Submit(p *Plan, timeout time.Duration) (uint64, error) {
	// Don't hand a dead worker's queue a plan the next one would run.
	if err := c.CheckWorker(); err != nil {
		return 0, err
	}
	seq := p.PlanSeq
	if seq == 0 {
		seq = c.nextSeq
	}
	if seq < c.nextSeq || seq > SF_PLAN_SEQ_MAX {
		return 0, &BoundsError{fmt.Sprintf("plan_seq %d: plans go in increasing order up to SF_PLAN_SEQ_MAX "+
			"(next is %d)", seq, c.nextSeq)}
	}
	msg := p.Encode(seq, c.Session)
	if len(msg) > int(c.v.plans.slot_bytes) {
		return 0, &BoundsError{fmt.Sprintf("a plan of %d bytes does not fit a plan slot (%d)", len(msg),
			c.v.plans.slot_bytes)}
	}
	i, err := c.waitSlot(c.v.plans, timeout, true, "plan queue room")
	if err != nil {
		return 0, err
	}
	copy(slot(c.v.plans, i), msg)
	C.sf_queue_publish(c.v.plans)
	c.nextSeq = seq + 1
	c.inflight[seq] = true
	return seq, nil
}

// WaitEvents is the next TickEvents of this session (a rejected plan is
// events too: look at Status). Op completions that arrive meanwhile are
// kept for Op.
func (c *Conn) WaitEvents(timeout time.Duration) (*Events, error) {
	deadline := time.Now().Add(timeout)
	for len(c.ready) == 0 {
		if err := c.pump(deadline); err != nil {
			return nil, err
		}
	}
	ev := c.ready[0]
	c.ready = c.ready[1:]
	return ev, nil
}

// Tick submits a plan and waits for its events (events of other plans that
// come first stay for WaitEvents).
func (c *Conn) Tick(p *Plan, timeout time.Duration) (*Events, error) {
	deadline := time.Now().Add(timeout)
	seq, err := c.Submit(p, timeout)
	if err != nil {
		return nil, err
	}
	for {
		for i, ev := range c.ready {
			if ev.PlanSeq == seq {
				c.ready = append(c.ready[:i], c.ready[i+1:]...)
				return ev, nil
			}
		}
		if err := c.pump(deadline); err != nil {
			return nil, err
		}
	}
}

// pump reads one event-queue message and files it.
func (c *Conn) pump(deadline time.Time) error {
	i, err := c.waitSlot(c.v.events, time.Until(deadline), false, "events")
	if err != nil {
		return err
	}
	err = c.read(slot(c.v.events, i))
	C.sf_queue_release(c.v.events)
	return err
}

// read files one message: this session's replies to ready/completions,
// notices as ErrWorkerGone or QueueResets; the rest is dropped.
func (c *Conn) read(s []byte) error {
	h, err := readAt[MsgHeader](s, 0)
	if err != nil {
		c.Dropped++
		return nil
	}
	notice := h.Kind == SF_MSG_WORKER || h.Kind == SF_MSG_RESET
	if h.Session != c.Session && !(h.Session == 0 && notice) {
		c.OtherSessions++
		return nil // an earlier session's reply, whatever its plan_seq or op_id
	}
	var msg any
	var epoch uint64
	switch h.Kind {
	case SF_MSG_EVENTS:
		ev, err := decodeEvents(s, h)
		if err != nil {
			c.Dropped++
			return nil
		}
		msg, epoch = ev, ev.WorkerEpoch
	case SF_MSG_OP_EVENTS:
		o, err := decodeOpEvents(s, h)
		if err != nil {
			c.Dropped++
			return nil
		}
		msg, epoch = o, o.epoch
	case SF_MSG_RESET:
		r, _, err := record[QueueReset](s, h)
		if err == nil {
			c.QueueResets = append(c.QueueResets, r)
		} else {
			c.Dropped++
		}
		return nil
	case SF_MSG_WORKER:
		n, _, err := record[WorkerNotice](s, h)
		if err != nil {
			c.Dropped++
			return nil
		}
		// A newer epoch, or ours dead: gone. Older news, or ours starting: nothing.
		if n.WorkerEpoch > c.Epoch || (n.WorkerEpoch == c.Epoch && goneState(n.WorkerState)) {
			return c.gone(0, &n)
		}
		return nil
	default:
		return nil // no business on this queue
	}
	if epoch > c.Epoch {
		// The next worker already answered (a plan sent before the restart).
		c.early = append(c.early, msg)
		return c.gone(epoch, nil)
	}
	c.fileMsg(msg)
	return nil
}

func (c *Conn) fileMsg(msg any) {
	switch m := msg.(type) {
	case *opEvents:
		if m.epoch < c.Epoch {
			return
		}
		c.fileCompletions(m.completions)
	case *Events:
		if m.WorkerEpoch < c.Epoch {
			return // a dead worker's answer: its plan is void
		}
		c.fileCompletions(m.Completions)
		if c.stale[m.PlanSeq] {
			// Sent to the old worker, run by this one: nobody waits for it,
			// but the lanes it admitted exist now and must be retired.
			delete(c.stale, m.PlanSeq)
			for _, r := range m.AdmitResults {
				c.orphans[r.LaneTag] = true
			}
			return
		}
		delete(c.inflight, m.PlanSeq)
		c.ready = append(c.ready, m)
	}
}

func (c *Conn) fileCompletions(cs []Completion) {
	for i := range cs {
		c.completions[cs[i].OpID] = &cs[i]
	}
}

// drainStale files what is queued already, without waiting (at connect: an
// earlier session's leftovers; at reconnect: the old worker's).
func (c *Conn) drainStale() {
	for C.sf_queue_peek_at(c.v.events) >= 0 {
		_ = c.pump(time.Now()) // a notice of the restart being handled: nothing more
	}
	c.ready = nil
	c.PartialEmits()
}

// TakeOrphans: lanes that plans sent before a restart admitted on the new
// worker (the planner did not mean them there): retire them.
func (c *Conn) TakeOrphans() []uint64 {
	out := make([]uint64, 0, len(c.orphans))
	for t := range c.orphans {
		out = append(out, t)
	}
	c.orphans = map[uint64]bool{}
	return out
}

// PartialEmits drains the stream queue: this session's tokens as they were
// sampled (plans with SF_PLAN_PARTIAL_EMITS).
func (c *Conn) PartialEmits() []PartialEmit {
	var out []PartialEmit
	for {
		i := C.sf_queue_peek_at(c.v.stream)
		if i < 0 {
			return out
		}
		s := slot(c.v.stream, int64(i))
		if h, err := readAt[MsgHeader](s, 0); err == nil && h.Kind == SF_MSG_PARTIAL && h.Session == c.Session {
			if p, _, err := record[PartialEmit](s, h); err == nil {
				out = append(out, p)
			}
		}
		C.sf_queue_release(c.v.stream)
	}
}
