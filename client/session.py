"""A planner's hold on one worker: the planner lock (one planner per worker),
the wait for a READY worker, the pid watch that tells a dead one, and the
errors a client raises when its worker is gone, taken or slow (contract §9;
abi/superfluid.h, "sessions")."""

from __future__ import annotations

import errno
import os
import select
import time

from superfluid.abi import WaitResult, WorkerState, ffi, lib
from superfluid.rings.liveness import pid_alive
from superfluid.rings.segment import Segment, state_name

_SIGNAL_SLICE_S = 0.1  # a futex wait returns to Python this often (Ctrl-C)


class ClientError(Exception):
    """Base of the client's errors."""


class ClientTimeout(ClientError, TimeoutError):
    """A wait ran past its timeout (the worker is alive but did not answer)."""


class WorkerRestarted(ClientError):
    """The worker this client talked to is gone: it died, was stopped, or the
    daemon replaced it. `epoch` is the segment's epoch when this was noticed:
    the new worker's once the daemon has bumped it, else still `old_epoch`
    (the daemon has not moved yet). `reconnect()` waits for the next READY
    worker either way. `state` is the segment's worker state then;
    `exit_status` and `restarts` come from the daemon's WorkerNotice when one
    said so (else None)."""

    def __init__(self, epoch: int, old_epoch: int, state: int, *, exit_status: int | None = None,
                 restarts: int | None = None):
        super().__init__(f"worker epoch {old_epoch} is gone (segment epoch {epoch}, state "
                         f"{state_name(state)})")
        self.epoch = epoch
        self.old_epoch = old_epoch
        self.state = state
        self.exit_status = exit_status
        self.restarts = restarts


class WorkerGaveUp(ClientError):
    """The daemon stopped restarting this worker (a crash loop)."""


class WorkerTaken(ClientError):
    """Another planner is connected to this worker: its queues have one
    producer and one consumer, so a second planner would steal its events."""


class DaemonGone(ClientError):
    """The daemon stopped its workers, or is dead: no worker will come back."""


class PidWatch:
    """Whether one pid is still running, for a look every plan: a pidfd
    (readable once the process has exited, a zombie included; immune to pid
    reuse) polled without waiting, about a microsecond, where /proc and
    kill(0) take tens. Where pidfds are missing (an old kernel), _pid_alive
    every time."""

    __slots__ = ("_dead", "_fd", "_poll", "pid")

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: int | None = None
        self._poll = None
        self._dead = pid <= 0
        if self._dead:
            return
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._dead = True
            return
        except (OSError, AttributeError):  # no pidfd_open here (ENOSYS, EINVAL for a thread id, ...)
            return
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)

    def alive(self) -> bool:
        if self._dead:
            return False
        if self._poll is None:
            return pid_alive(self.pid)
        if self._poll.poll(0):
            self._dead = True  # exited: it stays so
            self.close()
            return False
        return True

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd, self._poll = self._fd, None, None
            os.close(fd)

    def __del__(self) -> None:
        self.close()


def lock_planner(seg: Segment, name: str, index: int) -> int:
    """sf_session_lock: the exclusive flock on the segment file every
    language takes, held while connected (the kernel drops it when the
    planner's process dies)."""
    fd = os.open(seg.path, os.O_RDONLY | os.O_CLOEXEC)
    r = lib.sf_session_lock(fd)
    if r != 0:
        os.close(fd)
        if r == -errno.EWOULDBLOCK:
            raise WorkerTaken(f"{seg.path}: worker {index} of daemon {name!r} already has a planner "
                              "(one planner per worker: connect to another index, or close the other)")
        raise ClientError(f"{seg.path}: cannot lock: {os.strerror(-r)}")
    return fd


def wait_ready(seg: Segment, *, after: int | None, deadline: float) -> int:
    """The epoch of the segment's worker once it is READY and alive (and,
    with `after`, of a later epoch than that): sf_wait_ready, a futex sleep
    on the worker state, in slices so Ctrl-C is seen."""
    while True:
        left = deadline - time.monotonic()
        out = ffi.new("uint64_t *")
        r = lib.sf_wait_ready(seg.header, after or 0, int(max(0.0, min(left, _SIGNAL_SLICE_S)) * 1e9), out)
        if r == WaitResult.READY:
            return int(out[0])
        state, epoch = seg.worker_state, seg.epoch
        if r == WaitResult.GONE:
            if state == WorkerState.GAVE_UP:
                raise WorkerGaveUp(f"{seg.path}: the daemon gave up on this worker (epoch {epoch})")
            if state == WorkerState.STOPPED:
                raise DaemonGone(f"{seg.path}: the daemon stopped this worker (epoch {epoch}): it is shutting down")
            raise DaemonGone(f"{seg.path}: the daemon (pid {seg.header.daemon_pid}) is gone; no worker will be "
                             "restarted")
        if left <= _SIGNAL_SLICE_S:
            raise ClientTimeout(f"{seg.path}: no READY worker (epoch {epoch}, state {state_name(state)})")
