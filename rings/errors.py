"""Errors of the shared-memory transport."""

from __future__ import annotations

from typing import TYPE_CHECKING

from superfluid.abi import Status

if TYPE_CHECKING:
    from superfluid.abi.records import RingRef


class RingError(Exception):
    """Base of every transport error."""


class SegmentError(RingError):
    """A segment that cannot be created or opened: wrong owner, mode, magic,
    version or geometry. The message says which and what was found."""


class SegmentClosed(RingError):
    """The segment was closed; its queues and rings are gone with it."""


class PeerGone(RingError):
    """The worker the waiter was talking to is gone: its epoch changed (a
    restart) or it is stopped, dead or given up. `epoch` is the segment's
    epoch now, `state` its worker state."""

    def __init__(self, epoch: int, state: int, expected_epoch: int | None):
        super().__init__(f"worker epoch {expected_epoch} is gone (epoch now {epoch}, state {state})")
        self.epoch = epoch
        self.state = state
        self.expected_epoch = expected_epoch


class StopRequested(RingError):
    """The daemon asked this segment's worker to stop."""


class RefError(RingError):
    """A RingRef that cannot be read: `status` is RejectBounds or
    RejectBadRefGeneration."""

    def __init__(self, status: int, ref: RingRef | None, message: str):
        super().__init__(f"{Status(status).name}: {message} ({ref})")
        self.status = Status(status)
        self.ref = ref
