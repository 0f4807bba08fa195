"""`superfluid bench ring`'s rows through a real worker: empty ticks (a
TickPlan with no lists) sent to `superfluid serve --fake` and answered by
its worker, as a planner sees them, from Python (the Client) and from Rust
(the crate's `superfluid-bench` binary, over `Connection::tick`). Each row
also reports the worker's own tick, TickTimings.wall_ns of its events.

The codec-server rows of ring.py measure the transport and the codec; the
difference to these is what the worker does per plan.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

CRATE = Path(__file__).resolve().parents[2] / "client" / "rust"
BIN = "superfluid-bench"
_READY_S = 60.0
_BUILD_S = 900.0


class WorkerBenchError(RuntimeError):
    """The worker rows could not run: the daemon or the Rust bench failed."""


def _us(ns) -> float:
    return round(float(ns) / 1e3, 2)


def _affinity(cpu: int | None):
    return None if cpu is None else (lambda: os.sched_setaffinity(0, {cpu}))


def _start_daemon(name: str, cpu: int | None) -> subprocess.Popen[bytes]:
    """`superfluid serve --fake` (its worker inherits the CPU mask)."""
    return subprocess.Popen([sys.executable, "-P", "-m", "superfluid", "serve", "--fake", "--name", name,
                             "--log-level", "WARNING"], stdin=subprocess.DEVNULL, preexec_fn=_affinity(cpu))


def _stop_daemon(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM: the daemon stops its worker and removes its segment."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def python_row(name: str, rounds: int, warmup: int) -> dict[str, Any]:
    """Empty ticks through Client.tick: round trips and the worker's wall_ns."""
    from superfluid.abi import Status
    from superfluid.client import Client, PlanBuilder

    with Client.connect(name, 0, timeout=_READY_S) as c:
        clock = time.perf_counter_ns
        lat, wall = [], []
        for k in range(warmup + rounds):
            t0 = clock()
            ev = c.tick(PlanBuilder(0))
            t1 = clock()
            if ev.status != Status.OK:
                raise WorkerBenchError(f"an empty plan answered status {ev.status}: {ev.message!r}")
            if k >= warmup:
                lat.append(t1 - t0)
                wall.append(ev.timings.wall_ns)
    p50, p99 = np.percentile(lat, [50, 99])
    return {"p50_us": _us(p50), "p99_us": _us(p99), "mean_us": _us(np.mean(lat)),
            "worker_wall_p50_us": _us(np.median(wall))}


def rust_binary() -> tuple[Path | None, str | None]:
    """(the superfluid-bench binary, None) or (None, why there is none):
    built from client/rust (cargo build --release --offline; CARGO_TARGET_DIR
    is honoured), else one on PATH (the crate's wheel installs it)."""
    if (CRATE / "Cargo.toml").is_file() and shutil.which("cargo"):
        target = Path(os.environ.get("CARGO_TARGET_DIR") or CRATE / "target")
        r = subprocess.run(["cargo", "build", "--release", "--offline", "--quiet", "--bin", BIN], cwd=CRATE,
                           capture_output=True, text=True, timeout=_BUILD_S)
        if r.returncode != 0:
            return None, f"cargo build failed: {r.stderr.strip()[-400:]}"
        return target / "release" / BIN, None
    found = shutil.which(BIN)
    if found:
        return Path(found), None
    if not shutil.which("cargo"):
        return None, f"cargo is not installed and no {BIN} is on PATH"
    return None, f"no Rust crate at {CRATE} and no {BIN} on PATH"


def rust_row(binary: Path, name: str, rounds: int, warmup: int, cpu: int | None) -> dict[str, Any]:
    r = subprocess.run([str(binary), "--name", name, "--n", str(rounds), "--warmup", str(warmup)],
                       capture_output=True, text=True, timeout=600, preexec_fn=_affinity(cpu))
    if r.returncode != 0:
        raise WorkerBenchError(f"{BIN} exited with {r.returncode}: {r.stderr.strip()[-400:]}")
    got = json.loads(r.stdout)
    return {"p50_us": _us(got["p50_ns"]), "p99_us": _us(got["p99_ns"]), "mean_us": _us(got["mean_ns"]),
            "worker_wall_p50_us": _us(got["worker_wall_p50_ns"])}


def skipped(why: str | None) -> dict[str, Any]:
    """The rows' keys when they were not measured (`why` None: they were)."""
    return {"worker_rt_python_p50_us": None, "worker_rt_python_p99_us": None, "worker_tick_wall_p50_us": None,
            "worker_rt_rust_p50_us": None, "worker_rt_rust_p99_us": None, "worker_rt_rust_mean_us": None,
            "worker_tick_wall_rust_p50_us": None, "worker_rust_skipped": why, "worker_rounds": 0}


def run(rounds: int, warmup: int, *, rust: bool = True, client_cpu: int | None = None,
        worker_cpu: int | None = None) -> dict[str, Any]:
    """The worker rows: one daemon, the Python row, then the Rust row (or
    why it was skipped). The caller runs on client_cpu already."""
    binary, skipped_why = rust_binary() if rust else (None, "not asked (--no-rust)")
    name = f"bench-w{os.getpid()}-{secrets.token_hex(2)}"
    from superfluid.client.session import ClientError
    from superfluid.rings.errors import SegmentError

    proc = _start_daemon(name, worker_cpu)
    try:
        try:
            py = python_row(name, rounds, warmup)
        except (ClientError, SegmentError) as e:
            raise WorkerBenchError(f"the fake daemon (exit status {proc.poll()}): {e}") from None
        rs = rust_row(binary, name, rounds, warmup, client_cpu) if binary is not None else None
    finally:
        _stop_daemon(proc)
    out = skipped(skipped_why)
    out.update(worker_rt_python_p50_us=py["p50_us"], worker_rt_python_p99_us=py["p99_us"],
               worker_tick_wall_p50_us=py["worker_wall_p50_us"], worker_rounds=rounds)
    if rs is not None:
        out.update(worker_rt_rust_p50_us=rs["p50_us"], worker_rt_rust_p99_us=rs["p99_us"],
                   worker_rt_rust_mean_us=rs["mean_us"], worker_tick_wall_rust_p50_us=rs["worker_wall_p50_us"])
    return out
