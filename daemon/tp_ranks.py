"""A worker slot's tensor-parallel followers, as the daemon starts and ends them.

With --tp N the worker the daemon starts is rank 0 (the leader: the executor
and the segment, as always) and the daemon also starts ranks 1..N-1
(`python -m superfluid.daemon.tp_rank`), each watched by its own pidfd. The
group is fail-stop: any rank's exit kills the leader, the leader's exit
kills the ranks, and the daemon restarts the whole group under a new epoch.
Each epoch's ranks meet at a store file of their own and share a collective
segment `<segment>.tp<epoch>` (removed when the group ends; a daemon's start
removes any a SIGKILLed one left).
"""

from __future__ import annotations

import dataclasses
import glob
import logging
import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import Any

from superfluid.daemon.event_loop import EventLoop
from superfluid.daemon.worker_exits import describe_exit, die_with_parent, open_pidfd

log = logging.getLogger("superfluid.daemon")

KILL_WAIT_S = 5.0
STOP_GRACE_S = 2.0  # a cleanly stopped leader's followers exit on its word within this


@dataclasses.dataclass
class Rank:
    """One follower process (what the event loop's pidfd for it carries)."""

    worker: Any  # the supervisor's WorkerSlot whose group it belongs to
    rank: int
    epoch: int
    proc: subprocess.Popen[bytes]
    pidfd: int
    watched: bool = False  # the daemon's event loop has its pidfd


class TpRanks:
    """Ranks 1..world-1 of one worker slot: what the leader is told, the
    followers' commands, their processes, and the files of their meeting."""

    def __init__(self, segment: str, world: int, worker_args: Sequence[str], python: str,
                 env: Mapping[str, str] | None, local: int | None = None):
        self.segment, self.world = segment, world
        self.local = local or world  # ranks 0..local-1 run on this machine (--nnodes: the others elsewhere)
        self.worker_args = list(worker_args)
        self.python, self.env = python, dict(env) if env is not None else None
        self.live: list[Rank] = []
        self.epoch = 0

    def store(self, epoch: int) -> str:
        return f"{self.segment}.tp{epoch}.store"

    def shm(self, epoch: int) -> str:
        return f"{self.segment}.tp{epoch}"

    def leader_args(self, epoch: int) -> list[str]:
        """The leader's options for a group of `epoch`, its meeting files made fresh."""
        self.clean()
        self.epoch = epoch
        return ["--tp-init", f"file://{self.store(epoch)}", "--tp-shm", self.shm(epoch)]

    def start(self, worker: Any, leader_pid: int, loop: EventLoop) -> None:
        """The followers of the leader `leader_pid`, each watched by `loop` as
        it starts (so a failure to start the next leaves none unwatched); each
        dies with the daemon."""
        for r in range(1, self.local):
            cmd = [self.python, "-P", "-m", "superfluid.daemon.tp_rank", "--rank", str(r),
                   "--leader-pid", str(leader_pid), "--tp-init", f"file://{self.store(self.epoch)}",
                   "--tp-shm", self.shm(self.epoch), *self.worker_args]
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=self.env,
                                    preexec_fn=die_with_parent(os.getpid()))  # noqa: PLW1509
            rank = Rank(worker, r, self.epoch, proc, open_pidfd(proc))
            self.live.append(rank)
            loop.watch(rank.pidfd, rank)
            rank.watched = True
            log.info("worker %d: tp rank %d started: pid %d, epoch %d", worker.index, r, proc.pid, self.epoch)

    def exited(self, rank: Rank, loop: EventLoop, stopping: bool) -> None:
        """A follower ended: its group cannot go on (fail-stop), so its leader
        is killed, and the leader's exit restarts the group."""
        if not rank.watched:
            return  # reaped earlier in this round, with its leader's group
        loop.unwatch(rank.pidfd)
        rank.watched = False
        w, pid = rank.worker, rank.proc.pid
        status = self.reaped(rank)
        if stopping or rank.epoch != w.epoch or w.proc is None:
            log.info("worker %d: tp rank %d (pid %d) %s", w.index, rank.rank, pid, describe_exit(status))
            return
        log.warning("worker %d: tp rank %d (pid %d, epoch %d) %s: restarting the group", w.index, rank.rank, pid,
                    rank.epoch, describe_exit(status))
        w.proc.kill()

    def end(self, loop: EventLoop, stopped: bool = False) -> None:
        """The leader is gone: its followers too (killed if still there; after
        a grace when it `stopped` cleanly), and their meeting files."""
        for rank in self.live:
            if rank.watched:
                loop.unwatch(rank.pidfd)
                rank.watched = False
        self.kill(STOP_GRACE_S if stopped else 0.0)
        self.clean()

    def reaped(self, rank: Rank) -> int:
        """A follower's exit status, once its pidfd said it exited (closes the pidfd)."""
        os.close(rank.pidfd)
        rank.pidfd = -1
        if rank in self.live:
            self.live.remove(rank)
        return rank.proc.wait()

    def kill(self, grace_s: float = 0.0) -> list[Rank]:
        """SIGKILL every live follower (those still there after `grace_s`: a
        leader that stopped cleanly has told them to exit) and reap it; those
        reaped (their pidfds closed)."""
        gone = []
        deadline = time.monotonic() + grace_s
        for rank in list(self.live):
            try:
                rank.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            rank.proc.kill()
            try:
                rank.proc.wait(KILL_WAIT_S)
            except subprocess.TimeoutExpired:  # uninterruptible sleep; PDEATHSIG still covers it
                log.error("tp rank %d (pid %d) survived SIGKILL for %g s", rank.rank, rank.proc.pid, KILL_WAIT_S)
                continue
            gone.append(rank)
        for rank in gone:
            self.reaped(rank)
        return gone

    def clean(self) -> None:
        """Remove the meeting files of every epoch of this slot (none may be in use)."""
        for path in glob.glob(glob.escape(self.segment) + ".tp*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
