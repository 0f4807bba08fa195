"""The daemon: one segment and one worker process per index, restarted when
it dies (contract §1, §9, §10).

A single thread runs everything from one loop (event_loop.py) over:
- a pidfd per worker process (readable when it exits: a process sentinel,
  no polling, no SIGCHLD races);
- a self-pipe that `signal.set_wakeup_fd` writes SIGTERM/SIGINT/SIGHUP
  numbers into, and `Daemon.stop()` writes a 0 into from any thread.
Timers (restart backoffs, readiness checks while a worker is STARTING) are
the select timeout.

When a worker ends while the daemon serves: log how (exit code or signal)
and why, mark its segment DEAD with the exit status, put a WorkerNotice on
its event queue, then after an exponential backoff repair the segment
(whatever a planner scribbled on its header and geometry), bump the epoch
and start a fresh worker. A worker that fails N times within a window is
given up on (GAVE_UP). On SIGTERM/SIGINT: ask every worker to stop, SIGKILL
those that do not within the timeout, unlink every segment, exit 0.

The daemon commands a worker only through a socketpair made at spawn (a
planner can write every byte of the segment, never that); the segment's
stop_requested is only a report to planners that the daemon shuts down.

Workers get PR_SET_PDEATHSIG=SIGKILL, so none outlives a SIGKILLed daemon.
That signal follows the *thread* that forked the worker: run start() and
serve_forever() on a thread that lives until the daemon is done.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from superfluid.abi import WorkerState
from superfluid.daemon.control import STOP
from superfluid.rings.layout import SegmentConfig
from superfluid.rings.naming import segment_path
from superfluid.rings.segment import Segment

from .event_loop import EventLoop
from .metrics import WorkerMetrics
from .metrics_endpoint import DaemonCounters, MetricsServer, make_registry
from .segment_ownership import check_no_live_daemon, register_in_process, release_in_process, remove_stale_segments
from .status import worker_snapshot
from .tp_ranks import Rank, TpRanks
from .watchdog import DEFAULT_TICK_TIMEOUT_S, check_interval
from .worker_exits import KILL_WAIT_S
from .worker_life import WorkerLife, WorkerSlot

log = logging.getLogger("superfluid.daemon")

READY_CHECK_S = 0.05  # how often a STARTING worker's state is looked at

def segment_config_for(vocab_size: int, max_batch: int, base: SegmentConfig | None = None) -> SegmentConfig:
    """`base` (default sizes) with a logits ring of at least two steps of
    `max_batch` rows, so a tick's rows never overwrite the last tick's
    before the planner has read them."""
    base = base or SegmentConfig()
    need = 2 * max(1, max_batch) * max(0, vocab_size)
    return dataclasses.replace(base, logits_floats=max(base.logits_floats, need))


class Daemon(WorkerLife):
    """Supervises `workers` worker processes, each on its own segment
    `superfluid.<name>.<i>`.

    `worker_args`: the runtime options every worker gets (e.g. ["--fake"] or
    ["--model", DIR, "--backend", "torch"]); see worker_command() to vary
    them per worker. `crash_loop`: (failures, window seconds) after which a
    worker is given up on. In-process use: `d.start()` then `d.serve_forever()`
    (blocks; returns the exit status) and `d.stop()` from anywhere."""

    def __init__(self, name: str = "superfluid", worker_args: Sequence[str] = ("--fake",), *, workers: int = 1,
                 segment_config: SegmentConfig | None = None, fault_injection: bool = False,
                 restart_backoff: float = 1.0, restart_backoff_max: float = 30.0,
                 crash_loop: tuple[int, float] = (5, 60.0), stop_timeout: float = 10.0,
                 metrics_port: int | None = None, metrics_host: str = "127.0.0.1",
                 handle_signals: bool = True, python: str = sys.executable,
                 env: Mapping[str, str] | None = None, tp: int = 1, nnodes: int = 1,
                 tick_timeout: float = DEFAULT_TICK_TIMEOUT_S):
        segment_path(name, max(0, workers - 1))  # a bad name or count fails here, before anything is made
        if workers < 1:
            raise ValueError(f"workers = {workers}: must be >= 1")
        if crash_loop[0] < 1 or crash_loop[1] <= 0:
            raise ValueError(f"crash_loop = {crash_loop}: needs >= 1 failure in a positive window")
        if restart_backoff < 0 or restart_backoff_max < 0 or stop_timeout < 0:
            raise ValueError("restart_backoff, restart_backoff_max and stop_timeout must be >= 0")
        if tp < 1:
            raise ValueError(f"tp = {tp}: must be >= 1")
        self.name = name
        if tick_timeout < 0:
            raise ValueError(f"tick_timeout = {tick_timeout}: must be >= 0 (0: no stall watchdog)")
        self.tick_timeout = tick_timeout
        self.tp = tp  # rank processes a worker's group has (worker_args carry --tp for them)
        self.nnodes = nnodes  # machines they span: this one runs the first tp / nnodes
        self.n_workers = workers
        self.worker_args = list(worker_args)
        self.segment_config = segment_config or SegmentConfig()
        self.fault_injection = fault_injection
        self.restart_backoff = restart_backoff
        self.restart_backoff_max = restart_backoff_max
        self.crash_loop = (int(crash_loop[0]), float(crash_loop[1]))
        self.stop_timeout = stop_timeout
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.metrics_address: tuple[str, int] | None = None
        self.handle_signals = handle_signals
        self.python = python
        self.env = dict(env) if env is not None else None
        self._workers: list[WorkerSlot] = []
        self._loop: EventLoop | None = None
        self._stopping = False
        self._stop_requested = False  # set by stop(), from any thread
        self._restore_signals: Callable[[], None] = lambda: None
        self._registered: str | None = None  # this daemon's key in register_in_process
        self._started = False
        self._finished = False
        self._metrics: MetricsServer | None = None
        self.counters = DaemonCounters()  # how workers ended, for worker_exits_total
        self.unservable = False  # a worker exited EXIT_UNSERVABLE: serve_forever returns 2

    # --------------------------------------------------------------- public

    @property
    def segments(self) -> list[Segment]:
        return [w.seg for w in self._workers]

    def worker_command(self, index: int, segment: str, epoch: int) -> list[str]:
        """The command line of worker `index` (override to vary it per worker);
        the daemon adds its channel, metrics and geometry options to it."""
        # -P: the working directory is not put on sys.path (from a checkout, its
        # kernels/ folder would shadow the installed package of that name).
        cmd = [self.python, "-P", "-m", "superfluid.daemon.worker", "--segment", segment,
               "--epoch", str(epoch)]
        if self.fault_injection:
            cmd.append("--fault-injection")
        return cmd + self.worker_args

    def start(self) -> None:
        """Create the segments and start every worker; returns at once."""
        if self._started:
            raise RuntimeError("Daemon.start(): already started")
        if not hasattr(os, "pidfd_open"):
            raise OSError(errno.ENOSYS, "the daemon needs os.pidfd_open (Linux 5.3+)")
        self._started = True
        try:
            self._loop = EventLoop()
            # From here a SIGTERM is noted, not fatal: start-up looks for one
            # between steps and stops making segments and workers at once;
            # serve_forever then removes what was made.
            if self.handle_signals:
                self._restore_signals = self._loop.install_signals()
            self._check_no_live_daemon()
            for i in range(self.n_workers):
                if self._stop_pending():
                    return
                seg = Segment.create(self.name, i, self.segment_config, replace=True)
                seg.header.fault_injection = int(self.fault_injection)
                w = WorkerSlot(i, seg, metrics=WorkerMetrics.create(f"{self.name}.{i}"))
                if self.tp > 1:
                    w.ranks = TpRanks(seg.path, self.tp, self.worker_args, self.python, self.env,
                                      local=self.tp // self.nnodes)
                    w.ranks.clean()  # what a SIGKILLed daemon's group left
                self._workers.append(w)
            remove_stale_segments(self.name, self.n_workers)
            log.info("daemon %s (pid %d): %d worker(s), segments in %s, logits ring %d floats",
                     self.name, os.getpid(), self.n_workers, os.path.dirname(self._workers[0].seg.path),
                     self.segment_config.logits_floats)
            if self.metrics_port is not None:
                self._start_metrics()
            for w in self._workers:
                if self._stop_pending():
                    return
                self._spawn(w)
        except BaseException:
            self._shutdown(kill_now=True)
            self._restore_signals()
            raise

    def serve_forever(self) -> int:
        """Supervise until stopped (returns 0), until every worker was given
        up on (returns 1) or until a worker could never serve (EXIT_UNSERVABLE:
        returns 2). Handles SIGTERM/SIGINT/SIGHUP when called on
        the main thread and handle_signals is set."""
        if not self._started or self._finished:
            raise RuntimeError("Daemon.serve_forever(): call start() first, once")
        restore, self._restore_signals = self._restore_signals, lambda: None
        status = 0
        try:
            while not self._stopping:
                self._step(0.0 if self._stop_requested else self._timeout())
                if all(w.gave_up for w in self._workers) and not self.unservable:
                    log.error("every worker gave up; the daemon exits")
                    status = 1
                    break
            self._drain()
            if self.unservable:
                status = 2
        finally:
            self._shutdown(kill_now=True)  # nothing left to do after a drain; after an error, no orphans
            restore()
        return status

    def run(self) -> int:
        self.start()
        return self.serve_forever()

    def stop(self) -> None:
        """Ask serve_forever to drain and return (thread-safe; idempotent;
        before serve_forever runs, it makes serve_forever drain at once)."""
        self._stop_requested = True
        if (loop := self._loop) is not None:
            loop.wake(0)

    def snapshot(self) -> list[dict[str, Any]]:
        """Every worker's header and counters as plain data."""
        return [worker_snapshot(w.seg) for w in self._workers if not w.seg.closed]

    def worker_pid(self, index: int) -> int | None:
        p = self._workers[index].proc
        return p.pid if p is not None else None

    # ------------------------------------------------------------ the loop

    def _timeout(self) -> float | None:
        now = time.monotonic()
        due = [w.restart_at - now for w in self._workers if w.restart_at is not None]
        if any(w.proc is not None and not w.ready for w in self._workers):
            due.append(READY_CHECK_S)
        if self.tick_timeout and any(w.ready for w in self._workers):
            due.append(check_interval(self.tick_timeout))
        return max(0.0, min(due)) if due else None

    def _step(self, timeout: float | None) -> None:
        assert self._loop is not None
        for w in self._loop.select(timeout):
            if w is None:
                self._read_wakeups()
            elif isinstance(w, Rank):
                w.worker.ranks.exited(w, self._loop, self._stopping)
            else:
                self._reap(w)
        if self._stop_requested and not self._stopping:
            log.info("stop requested")
            self._stopping = True
        self._check_ready()
        self._watch_stalls()
        now = time.monotonic()
        for w in self._workers:
            if w.restart_at is not None and w.restart_at <= now and not self._stopping:
                w.restart_at = None
                self._spawn(w)

    def _read_wakeups(self) -> None:
        assert self._loop is not None
        for b in self._loop.read():
            self._on_wakeup(b)

    def _on_wakeup(self, signum: int) -> None:
        if signum == 0:
            pass  # stop(): _step looks at the flag
        elif signum in (signal.SIGTERM, signal.SIGINT):
            if self._stopping:
                log.warning("%s received while stopping: killing the workers now", signal.Signals(signum).name)
                self._kill_all()
            else:
                log.info("%s received: stopping", signal.Signals(signum).name)
            self._stopping = True
        elif signum == signal.SIGHUP:
            self._retry_given_up()

    def _stop_pending(self) -> bool:
        """Whether a SIGTERM/SIGINT (or stop()) came during start(): read now, not after it."""
        self._read_wakeups()
        return self._stopping or self._stop_requested

    # ------------------------------------------------------------ shutdown

    def _drain(self) -> None:
        """Ask every worker to stop; SIGKILL those still there after stop_timeout."""
        live = [w for w in self._workers if w.proc is not None]
        log.info("stopping %d worker(s) (timeout %g s)", len(live), self.stop_timeout)
        for w in self._workers:
            w.restart_at = None
            w.seg.request_stop()  # the planners' report; the worker hears it below
            self._command(w, STOP)
        deadline = time.monotonic() + self.stop_timeout
        while any(w.proc is not None for w in self._workers):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._step(left)
        late = [w for w in self._workers if w.proc is not None]
        if late:
            log.warning("worker(s) %s did not stop within %g s: killing them", ", ".join(str(w.index) for w in late),
                        self.stop_timeout)
            self._kill_all()

    def _command(self, w: WorkerSlot, cmd: bytes) -> None:
        if w.control is None:
            return
        try:
            w.control.send(cmd)
        except OSError as e:  # gone already, or its buffer is full of earlier commands
            log.debug("worker %d: command %r not sent: %s", w.index, cmd, e)

    def _kill_all(self) -> None:
        for w in self._workers:
            if w.proc is not None:
                pid = w.proc.pid
                w.proc.kill()
                try:
                    w.proc.wait(KILL_WAIT_S)
                except subprocess.TimeoutExpired:  # uninterruptible sleep; PDEATHSIG still covers it
                    log.error("worker %d (pid %d) survived SIGKILL for %g s", w.index, pid, KILL_WAIT_S)
                    continue
                self._unwatch(w)
                log.info("worker %d (pid %d) killed", w.index, pid)
        for w in self._workers:
            self._end_group(w)

    def _shutdown(self, *, kill_now: bool) -> None:
        """Release everything: workers (killed), metrics, segments (unlinked), fds."""
        if self._finished:
            return
        self._finished = True
        if self._registered is not None:
            release_in_process(self._registered)
            self._registered = None
        self._stopping = True
        if kill_now:
            self._kill_all()
        if self._metrics is not None:
            self._metrics.close()  # before the segments and blocks it reads are unmapped
            self._metrics = None
        for w in self._workers:
            self._end_group(w)
            if w.control is not None:
                w.control.close()
                w.control = None
            if w.metrics is not None:
                w.metrics.close()
                w.metrics = None
            if not w.seg.closed:
                if w.seg.worker_state not in (WorkerState.STOPPED, WorkerState.GAVE_UP):
                    w.seg.set_worker_state(WorkerState.STOPPED)  # a planner still mapped sees PeerGone
                w.seg.close()
            w.seg.unlink()
        if self._loop is not None:
            self._loop.close()
        if self._workers:
            log.info("daemon %s stopped; segments removed", self.name)

    def _check_no_live_daemon(self) -> None:
        """`replace=True` must only ever replace a dead daemon's segments."""
        self._registered = register_in_process(self.name)
        check_no_live_daemon(self.name)

    # ------------------------------------------------------------- metrics

    def _start_metrics(self) -> None:
        assert self.metrics_port is not None
        self._metrics = MetricsServer(make_registry(self.name, self._metric_sources, self.counters),
                                      self.metrics_host, self.metrics_port)
        self.metrics_address = self._metrics.address
        log.info("metrics on http://%s:%d/metrics", *self.metrics_address)

    def _metric_sources(self):
        # Scrape threads: a segment closed at shutdown is skipped, not read.
        for w in list(self._workers):
            seg, block = w.seg, w.metrics
            if block is None or seg.closed or block.closed:
                continue
            try:
                yield w.index, block, worker_snapshot(seg)
            except Exception:  # closed under us by the shutdown
                continue
