"""A worker slot's life under the daemon (supervisor.py): its start (the
segment repaired, the epoch bumped, unread plans dropped), readiness, the
stall watchdog, its exit, then a restart after a backoff or, after too many
failures in the window, giving up; the planner hears each through a
WorkerNotice on the event queue (contract §9)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import time
from typing import Any

from superfluid.abi import WorkerState, codec, ffi
from superfluid.abi.records import WorkerNotice
from superfluid.rings.layout import SegmentConfig
from superfluid.rings.segment import Segment

from .event_loop import EventLoop
from .metrics_endpoint import DaemonCounters, exit_reason
from .tp_ranks import TpRanks
from .watchdog import stall_age
from .worker import EXIT_UNSERVABLE
from .worker_exits import EXIT_SPAWN_FAILED, describe_exit, die_with_parent, open_pidfd, short_exit

log = logging.getLogger("superfluid.daemon")

_COUNTERS_BYTES = ffi.sizeof("WorkerCounters")


def restart_delay(failures: int, base: float, cap: float) -> float:
    """Backoff before the next start after `failures` recent failures (>= 1):
    base, 2 base, 4 base, ... capped. Failures older than the crash-loop
    window no longer count, so a worker that ran well starts again at base."""
    return min(base * 2 ** max(0, failures - 1), cap)


@dataclasses.dataclass
class WorkerSlot:
    """One index's segment and the worker process serving it, across restarts."""

    index: int
    seg: Segment
    proc: subprocess.Popen[bytes] | None = None
    pidfd: int = -1
    epoch: int = 0
    started: float = 0.0  # monotonic time of the last start
    ready: bool = False
    restart_at: float | None = None  # monotonic time of a pending restart
    failures: collections.deque[float] = dataclasses.field(default_factory=collections.deque)
    gave_up: bool = False
    restarts: int = 0
    control: socket.socket | None = None  # the daemon's end of the worker's command channel
    metrics: Any = None  # the WorkerMetrics block this slot's workers record into
    ranks: TpRanks | None = None  # --tp > 1: the leader's followers
    stalled: bool = False  # killed by the stall watchdog (its exit is counted as "stalled")


class WorkerLife:
    """The Daemon's methods for one slot at a time (a mixin: the Daemon owns
    the state below)."""

    _workers: list[WorkerSlot]
    _loop: EventLoop | None
    _stopping: bool
    fault_injection: bool
    segment_config: SegmentConfig
    env: dict[str, str] | None
    crash_loop: tuple[int, float]
    restart_backoff: float
    restart_backoff_max: float
    tick_timeout: float
    counters: DaemonCounters
    unservable: bool

    def worker_command(self, index: int, segment: str, epoch: int) -> list[str]:
        raise NotImplementedError

    def _spawn(self, w: WorkerSlot) -> None:
        seg = w.seg
        h = seg.header
        for fix in seg.repair(fault_injection=self.fault_injection):
            log.warning("worker %d: segment repaired before the start: %s", w.index, fix)
        # The new worker counts from zero (status: "tokens emitted since the worker started").
        ffi.memmove(ffi.addressof(h, "counters"), bytes(_COUNTERS_BYTES), _COUNTERS_BYTES)
        h.worker_pid = 0
        # The daemon's count, not the header's: that one is anyone's to scribble on.
        w.epoch += 1
        seg.set_epoch(w.epoch)
        seg.set_worker_state(WorkerState.STARTING)
        # Plans and ops the dead worker never read were meant for a state that is gone:
        # the new worker starts clean and the planner re-admits (contract §9).
        dropped = seg.plan_queue.discard_unread() + seg.op_queue.discard_unread()
        if dropped:
            log.info("worker %d: dropped %d unread plan/op messages of the old epoch", w.index, dropped)
        if w.restarts:
            # Before the new worker exists, the daemon is the event queue's only producer.
            self._notice(w, WorkerState.STARTING)
            w.metrics.restarted()  # the new worker's gauges start from nothing
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        fds = (theirs.fileno(), w.metrics.fd)
        cmd = self.worker_command(w.index, seg.path, w.epoch) + [
            "--control-fd", str(fds[0]), "--metrics-fd", str(fds[1]),
            "--segment-config", self.segment_config.to_json()]
        if w.ranks is not None:
            cmd += w.ranks.leader_args(w.epoch)
        w.ready = False
        w.started = time.monotonic()
        try:
            # preexec_fn with threads about (metrics): it only calls prctl, getppid and kill,
            # which take no lock another thread could hold at fork time.
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, env=self.env, pass_fds=fds,
                                    preexec_fn=die_with_parent(os.getpid()))  # noqa: PLW1509
        except (OSError, subprocess.SubprocessError) as e:
            ours.close()
            theirs.close()
            log.error("worker %d: cannot start %s: %s", w.index, cmd[0], e)
            self._failed(w, EXIT_SPAWN_FAILED)
            return
        theirs.close()
        w.control = ours
        pidfd = open_pidfd(proc)
        w.proc, w.pidfd = proc, pidfd
        h.worker_pid = proc.pid  # the worker writes it too; status shows it while STARTING
        assert self._loop is not None
        self._loop.watch(pidfd, w)
        log.info("worker %d started: pid %d, epoch %d", w.index, proc.pid, w.epoch)
        if w.ranks is not None:
            try:
                w.ranks.start(w, proc.pid, self._loop)
            except (OSError, subprocess.SubprocessError) as e:  # the leader alone cannot serve: restart the group
                log.error("worker %d: cannot start its tp ranks: %s", w.index, e)
                proc.kill()

    def _end_group(self, w: WorkerSlot, stopped: bool = False) -> None:
        if w.ranks is not None:
            assert self._loop is not None
            w.ranks.end(self._loop, stopped)

    def _check_ready(self) -> None:
        for w in self._workers:
            if w.proc is None or w.ready or w.seg.epoch != w.epoch:
                continue
            if w.seg.worker_state == WorkerState.READY:
                w.ready = True
                rt = w.seg.runtime
                rid = rt.runtime_id.decode(errors="replace") if isinstance(rt.runtime_id, bytes) else rt.runtime_id
                log.info("worker %d ready (epoch %d, pid %d) in %.2f s: %s, vocab %d, max_batch %d",
                         w.index, w.epoch, w.proc.pid, time.monotonic() - w.started, rid, rt.vocab_size,
                         rt.max_batch)

    def _watch_stalls(self) -> None:
        """Kill a ready worker whose heartbeat has not moved for --tick-timeout (watchdog.py)."""
        if not self.tick_timeout or self._stopping:
            return
        now = time.monotonic_ns()
        for w in self._workers:
            if w.proc is None or not w.ready or w.stalled:
                continue
            age = stall_age(w.metrics.heartbeat(), now, self.tick_timeout)
            if age is None:
                continue
            c = w.seg.counters  # (the header's: only for the log)
            log.error("worker %d (pid %d, epoch %d) stalled: its loop has not moved for %.1f s (--tick-timeout "
                      "%g; %d ticks, last plan_seq %d; a tick or an op did not return): killing it", w.index,
                      w.proc.pid, w.epoch, age, self.tick_timeout, c.ticks, c.last_plan_seq)
            w.stalled = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(w.proc.pid, signal.SIGKILL)

    def _unwatch(self, w: WorkerSlot) -> int:
        """Stop watching w's exited process; its exit status."""
        assert w.proc is not None and self._loop is not None
        self._loop.unwatch(w.pidfd)
        os.close(w.pidfd)
        w.pidfd = -1
        if w.control is not None:
            w.control.close()
            w.control = None
        status = w.proc.wait()  # the pidfd said it exited: this reaps, it does not block
        w.proc = None
        return status

    def _reap(self, w: WorkerSlot) -> None:
        if w.proc is None:
            return  # reaped earlier in this round (killed after a second SIGTERM)
        pid = w.proc.pid
        status = self._unwatch(w)
        self._end_group(w, stopped=self._stopping and status == 0)
        lived = time.monotonic() - w.started
        if self._stopping:
            log.info("worker %d (pid %d) %s", w.index, pid, "stopped" if status == 0 else describe_exit(status))
            return
        log.warning("worker %d (pid %d, epoch %d) %s after %.1f s", w.index, pid, w.epoch,
                    describe_exit(status), lived)
        self._failed(w, status)

    def _failed(self, w: WorkerSlot, status: int) -> None:
        """A worker ended (or could not start) while the daemon serves."""
        h = w.seg.header
        h.last_exit_status = status
        reason = "stalled" if w.stalled else "spawn_failed" if status == EXIT_SPAWN_FAILED else exit_reason(status)
        w.stalled = False
        self.counters.exited(w.index, reason)
        if status == EXIT_UNSERVABLE:
            w.gave_up = True
            w.seg.set_worker_state(WorkerState.GAVE_UP)
            self._notice(w, WorkerState.GAVE_UP)
            log.error("worker %d cannot serve this model or these options (its message is above): a restart "
                      "would fail the same way; the daemon stops", w.index)
            self.unservable = True
            self._stopping = True
            return
        now = time.monotonic()
        n, window = self.crash_loop
        w.failures.append(now)
        while w.failures and w.failures[0] < now - window:
            w.failures.popleft()
        if len(w.failures) >= n:
            w.gave_up = True
            w.seg.set_worker_state(WorkerState.GAVE_UP)
            self._notice(w, WorkerState.GAVE_UP)
            log.error("worker %d failed %d times in %g s (last: %s); giving up on it", w.index, len(w.failures),
                      window, short_exit(status))
            return
        w.seg.set_worker_state(WorkerState.DEAD)
        w.restarts += 1  # counted here: the header's copy is anyone's to scribble on
        h.restarts = w.restarts & 0xFFFFFFFF
        self._notice(w, WorkerState.DEAD)
        delay = restart_delay(len(w.failures), self.restart_backoff, self.restart_backoff_max)
        w.restart_at = now + delay
        log.info("restarting worker %d in %.3g s (%d failure(s) in the last %g s; giving up at %d)", w.index,
                 delay, len(w.failures), window, n)

    def _notice(self, w: WorkerSlot, state: WorkerState) -> None:
        """Tell the planner through the event queue: DEAD or GAVE_UP with the
        dead worker's epoch, STARTING with the new one. Only while no worker
        produces on that queue (the last one died, the next is not started).
        A full queue skips the notice: the epoch and state in the header say
        it all the same."""
        h = w.seg.header
        slot = w.seg.event_queue.try_reserve()
        if slot is None:
            log.debug("worker %d: event queue full, no WorkerNotice", w.index)
            return
        codec.encode_into(slot, "WorkerNotice", WorkerNotice(
            worker_epoch=w.seg.epoch, worker_state=int(state), exit_status=int(h.last_exit_status),
            restarts=w.restarts & 0xFFFFFFFF))
        w.seg.event_queue.try_publish()  # False: a planner filled it meanwhile; the header says it all the same

    def _retry_given_up(self) -> None:
        """SIGHUP: start again the workers that gave up (the cause may be fixed)."""
        again = [w for w in self._workers if w.gave_up]
        if not again:
            log.info("SIGHUP: no worker gave up; nothing to retry")
        for w in again:
            log.info("SIGHUP: retrying worker %d", w.index)
            w.gave_up = False
            w.failures.clear()
            w.restart_at = time.monotonic()
