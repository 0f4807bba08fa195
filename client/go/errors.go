package superfluid

import (
	"errors"
	"fmt"
)

// ErrWorkerGone is what every *WorkerGoneError is (errors.Is): the worker
// died or was replaced; Reconnect, then re-admit (contract §9).
var ErrWorkerGone = errors.New("superfluid: the worker is gone")

// ErrTaken: another planner holds the worker (sf_session_lock said EWOULDBLOCK).
var ErrTaken = errors.New("superfluid: another planner holds this worker")

// SegmentError: no segment, or not one this build can use.
type SegmentError struct {
	Path string
	Code int // SF_CONNECT_* (sf_segment_open), or -1 for an OS error (Msg)
	Msg  string
}

func (e *SegmentError) Error() string {
	if e.Code >= 0 {
		return fmt.Sprintf("%s: sf_segment_open says %d (SF_CONNECT_%s)%s", e.Path, e.Code, ConnectName(e.Code), e.Msg)
	}
	return fmt.Sprintf("%s: %s", e.Path, e.Msg)
}

// TimeoutError: a wait ran past its timeout (the worker is alive but did not answer).
type TimeoutError struct{ What string }

func (e *TimeoutError) Error() string { return "superfluid: timed out waiting for " + e.What }

// WorkerGoneError: the worker of OldEpoch no longer serves. Epoch is the
// segment's epoch when it was noticed; the notice fields are set when a
// daemon's WorkerNotice said so.
type WorkerGoneError struct {
	Epoch, OldEpoch uint64
	State           uint32
	Notice          *WorkerNotice
}

func (e *WorkerGoneError) Error() string {
	return fmt.Sprintf("worker epoch %d is gone (segment epoch %d, state %s)", e.OldEpoch, e.Epoch,
		WorkerStateName(e.State))
}

func (e *WorkerGoneError) Is(target error) bool { return target == ErrWorkerGone }

// DaemonGoneError: no worker will come back (the daemon stopped, died, or
// gave up on this worker: GaveUp).
type DaemonGoneError struct {
	Path   string
	State  uint32
	GaveUp bool
}

func (e *DaemonGoneError) Error() string {
	if e.GaveUp {
		return e.Path + ": the daemon gave up on this worker"
	}
	return fmt.Sprintf("%s: the daemon is gone or stopping (worker state %s); no worker will be restarted", e.Path,
		WorkerStateName(e.State))
}

// BoundsError: a message that does not fit, or a reference outside a ring.
type BoundsError struct{ Msg string }

func (e *BoundsError) Error() string { return "superfluid: " + e.Msg }

// RejectError: the worker refused a plan (it changed nothing).
type RejectError struct {
	PlanSeq uint64
	Status  uint32 // SF_STATUS_*
	Message string
}

func (e *RejectError) Name() string { return StatusName(e.Status) }

func (e *RejectError) Error() string {
	return fmt.Sprintf("plan %d rejected: %s: %s", e.PlanSeq, e.Name(), e.Message)
}

// OpError: an op completed with a status other than OK.
type OpError struct {
	Op      string // the op's name
	Status  uint32 // SF_OPST_*
	Message string // the completion's {error} payload
}

func (e *OpError) Name() string { return OpStatusName(e.Status) }

func (e *OpError) Error() string { return fmt.Sprintf("%s failed: %s: %s", e.Op, e.Name(), e.Message) }
