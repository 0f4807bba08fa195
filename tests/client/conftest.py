"""Workers for the client tests: a segment with a real worker process on it,
restartable the way the daemon does it (kill -9, mark DEAD, bump the epoch,
start a fresh process), and removed at the end whatever happened.

Worker processes are forked by a zygote (tests/client/zygote.py) that paid
the imports once, so a restart costs a fork rather than a cold interpreter."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import threading
import time

import pytest

from superfluid.abi import WorkerState
from superfluid.client import Client
from superfluid.rings.layout import SegmentConfig
from superfluid.rings.segment import Segment
from superfluid.testing.daemon import FAKE_WORKER
from superfluid.testing.launch import python

CFG = SegmentConfig(plan_slots=8, plan_slot_bytes=16384, event_slots=8, event_slot_bytes=65536, op_slots=16,
                    op_slot_bytes=4096, stream_slots=1024, stream_slot_bytes=64, prompt_tokens=1 << 15,
                    emit_tokens=1 << 15, logits_floats=1 << 17)
_names = itertools.count()


class Zygote:
    """The forking process; calls are serialized (a test may restart a
    worker from a second thread)."""

    def __init__(self):
        path = os.path.join(os.path.dirname(__file__), "zygote.py")
        self.proc = subprocess.Popen([*python(), path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._lock = threading.Lock()

    def call(self, cmd: str, arg) -> dict:
        with self._lock:
            self.proc.stdin.write(json.dumps([cmd, arg]) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the zygote died (exit {self.proc.poll()})")
        return json.loads(line)

    def children(self) -> list[int]:
        """Processes the zygote forked that are still there (zombies too)."""
        out = []
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                if ppid == self.proc.pid:
                    out.append(int(d))
        return out

    def close(self) -> None:
        left = self.children()
        self.proc.stdin.close()
        self.proc.wait(30)
        self.proc.stdout.close()
        assert not left, f"worker processes left behind: {left}"


class WorkerProcess:
    """A segment and the worker serving it, with the daemon's restart steps."""

    def __init__(self, zygote: Zygote, name: str, args: tuple[str, ...]):
        self.zygote = zygote
        self.name = name
        self.args = args
        self.seg = Segment.create(name, 0, CFG)
        self.pid: int | None = None  # the running worker, not yet reaped
        self.epoch = 0

    def start(self, timeout: float = 60.0) -> int:
        """A fresh worker process on a new epoch; returns once it is READY."""
        self.epoch = self.seg.bump_epoch()
        argv = ["--segment", self.seg.path, "--epoch", str(self.epoch), *self.args]
        self.pid = self.zygote.call("start", argv)["pid"]
        deadline = time.monotonic() + timeout
        while self.seg.worker_state != WorkerState.READY or self.seg.epoch != self.epoch:
            status = self.zygote.call("poll", self.pid)["status"]
            if status is not None or time.monotonic() > deadline:
                self.pid = None if status is not None else self.pid
                raise RuntimeError(f"worker of epoch {self.epoch} did not become ready (exit {status})")
            time.sleep(0.005)
        return self.epoch

    def kill(self) -> int:
        """kill -9, reaped, and the segment marked as the daemon would."""
        assert self.pid is not None
        os.kill(self.pid, signal.SIGKILL)
        status = self.zygote.call("reap", self.pid)["status"]
        self.pid = None
        self.seg.header.last_exit_status = status
        self.seg.set_worker_state(WorkerState.DEAD)
        return status

    def restart(self) -> int:
        self.kill()
        return self.start()

    def connect(self, timeout: float = 30.0) -> Client:
        return Client.connect(self.name, 0, timeout=timeout)

    def close(self) -> None:
        if self.pid is not None:
            os.kill(self.pid, signal.SIGCONT)  # in case a test left it stopped
            os.kill(self.pid, signal.SIGTERM)  # no daemon channel: SIGTERM is the stop
            deadline = time.monotonic() + 10
            while self.zygote.call("poll", self.pid)["status"] is None:
                if time.monotonic() > deadline:
                    os.kill(self.pid, signal.SIGKILL)
                    self.zygote.call("reap", self.pid)
                    break
                time.sleep(0.01)
            self.pid = None
        self.seg.close()
        self.seg.unlink()


@pytest.fixture(scope="session")
def zygote(shm_dir):
    z = Zygote()
    yield z
    z.close()


@pytest.fixture
def start_worker(zygote):
    """start_worker(*args) -> a READY WorkerProcess (args: worker options)."""
    made: list[WorkerProcess] = []

    def start(*args: str) -> WorkerProcess:
        w = WorkerProcess(zygote, f"c{os.getpid()}-{next(_names)}", args or FAKE_WORKER)
        made.append(w)
        w.start()
        return w

    yield start
    for w in made:
        w.close()


@pytest.fixture(scope="module")
def fake_worker(zygote):
    """One fake worker (fault injection on) shared by a module's tests."""
    w = WorkerProcess(zygote, f"m{os.getpid()}-{next(_names)}", (*FAKE_WORKER, "--fault-injection"))
    try:
        w.start()
        yield w
    finally:
        w.close()
