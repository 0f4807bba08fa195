"""Live daemons for tests: `superfluid serve` as a subprocess (its log in a
file), waiting on it, reading its status, and checking that no worker of it
is left."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from superfluid.daemon.status import read_status
from superfluid.rings.naming import parse_segment_path, shm_dir
from superfluid.testing.launch import python

WAIT_S = 60.0  # generous: a loaded 2-core CI box starts a worker in seconds, not milliseconds


def wait_for(pred: Callable[[], object], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def segment_files(name: str) -> list[str]:
    """The segment files of daemon `name` (not its state directory)."""
    return [f for f in os.listdir(shm_dir()) if (parse_segment_path(f) or ("",))[0] == name]


def state_of(name: str, index: int = 0) -> dict | None:
    st = read_status(name)
    if st is None or len(st["workers"]) <= index or "error" in st["workers"][index]:
        return None
    return st["workers"][index]


class Serve:
    """`superfluid serve` as a subprocess, its log in a file."""

    def __init__(self, tmp_path: Path, name: str, *args: str):
        self.name = name
        self.log_path = tmp_path / f"{name}.log"
        with open(self.log_path, "wb") as log:
            # The environment carries the test session's SUPERFLUID_SHM_DIR.
            self.proc = subprocess.Popen(python("-m", "superfluid", "serve", "--name", name, *args),
                                         stdout=log, stderr=log, env=dict(os.environ))

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_log(self, text: str) -> None:
        wait_for(lambda: text in self.log or self.proc.poll() is not None, f"log line {text!r}")
        assert text in self.log, self.log

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        wait_for(lambda: not live_workers(self.name), "workers to die with the daemon", 10)
        for f in segment_files(self.name):
            os.unlink(os.path.join(shm_dir(), f))
        # A killed daemon leaves its default state directory (a stopped one removes it when empty).
        shutil.rmtree(os.path.join(shm_dir(), f"superfluid.{self.name}.state"), ignore_errors=True)


def live_workers(name: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line names a segment of `name`."""
    return live_processes(f"superfluid.{name}.".encode(), b"superfluid.daemon.worker")


def live_ranks(marker: bytes) -> list[int]:
    """Pids of live tensor-parallel follower ranks whose command line holds `marker`."""
    return live_processes(marker, b"superfluid.daemon.tp_rank")


def live_processes(marker: bytes, module: bytes) -> list[int]:
    """Pids of live (not zombie) processes running `module` whose command line holds `marker`."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{d}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and module in cmd and state != b"Z":
            pids.append(int(d))
    return pids


def run_requests(name: str, reqs: list[dict], kill: Callable[[], None] | None = None,
                 timeout_s: float = 300) -> tuple[list[list[int]], int, Any]:
    """Serve `reqs` (prompt, max_new_tokens, sampling, params, rng_base) through
    the reference planner on worker 0 of daemon `name`, calling `kill` once
    when some lane has 3 tokens: each request's tokens, the restarts the
    planner saw, and the worker's parallel layout (DESCRIBE)."""
    from superfluid.client import Client
    from superfluid.client.planner import Planner

    with Client.connect(name, 0, timeout=180) as c:
        p = Planner(c, prefill_token_budget=64, decode_grant=3)
        ids = [p.submit(r["prompt"], r["max_new_tokens"], r["sampling"], params=r["params"], rng_base=r["rng_base"],
                        stop_at_eos=False) for r in reqs]
        done = False
        deadline = time.monotonic() + timeout_s
        while p.busy():
            assert time.monotonic() < deadline, "requests never finished"
            p.step(60)
            if kill is not None and not done and any(len(ln.request.generated) >= 3 for ln in p.lanes.values()):
                kill()
                done = True
        assert kill is None or done, "the fault was never injected"
        rep = p.report()
        return [rep.results[i].tokens for i in ids], p.stats.restarts, c.parallel()


# A worker of the fake runtime, as the client tests start one (without a daemon).
FAKE_WORKER = ("--fake", "--page", "4", "--max-seq-len", "512", "--max-batch", "16")
# A daemon of the fake runtime that restarts its workers at once and often.
FAKE = ("--fake", "--page", "4", "--max-seq-len", "512", "--fake-step-cost", "0.004", "--fault-injection",
        "--restart-backoff", "0.05", "--crash-loop", "50/60")


def start_fake(tmp_path_factory, prefix: str) -> Serve:
    """A `superfluid serve` of the fake runtime, READY (a module's daemon)."""
    s = Serve(tmp_path_factory.mktemp(prefix), f"{prefix}{os.getpid()}", *FAKE)
    try:
        s.wait_log("worker 0 ready (epoch 1")
    except BaseException:
        s.close()
        raise
    return s
