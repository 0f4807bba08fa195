"""For fault-injection harnesses: a daemon on a model, with fault injection
on, a fault schedule, a flight record and the stall watchdog as asked, and a
connected reference Planner (docs/faults.md, docs/recorder.md).

    from superfluid.testing.harness import faulty_daemon

    with faulty_daemon(schedule={"rules": [...]}) as h:
        rid = h.planner.submit(prompt, 16)
        h.planner.run_until_done(120)

or, in pytest, the `faulty_daemon_factory` fixture (with
`pytest_plugins = ["superfluid.testing.harness"]`): a function that takes
the same arguments and returns a Harness; every daemon it started stops at
the end of the test. The daemon runs in this process (a thread), its workers as
processes; it is stopped, its workers and segments gone, when the block
ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from superfluid.client import Client
from superfluid.client.planner import Planner
from superfluid.daemon.supervisor import Daemon

__all__ = ["Harness", "faulty_daemon"]

_count = iter(range(1 << 30))


@dataclass
class Harness:
    daemon: Daemon
    client: Client
    planner: Planner

    @property
    def name(self) -> str:
        return self.daemon.name

    def install_faults(self, rules: Sequence[Mapping[str, Any]], seed: int = 0) -> int:
        """Op INSTALL_FAULTS on the running worker; the rules installed."""
        done = self.client.op("INSTALL_FAULTS", timeout=60, rules=list(rules), seed=seed)
        if done.status:
            import msgpack

            raise ValueError(msgpack.unpackb(done.payload)["error"])
        return int(done.value)

    def exits(self) -> dict[tuple[int, str], int]:
        """How the daemon's workers ended so far, by (worker, reason): "exit_70", "stalled", ..."""
        return self.daemon.counters.exits()


@contextlib.contextmanager
def faulty_daemon(model: str | None = None, *, schedule: Mapping[str, Any] | None = None,
                  record: str | os.PathLike[str] | None = None, tick_timeout: float = 300.0,
                  serve_args: Sequence[str] = (), name: str | None = None,
                  planner_options: Mapping[str, Any] | None = None) -> Iterator[Harness]:
    """A daemon (one worker) on `model` (default: the embedded tiny model)
    with fault injection, `schedule` ({seed, rules}: installed at every start
    of the worker, as serve --fault-schedule), a flight record in `record`
    (`superfluid replay` reads it: docs/recorder.md), the watchdog at
    `tick_timeout`, quick restarts; yields a Harness with a connected Planner."""
    from superfluid.engine.tiny import default_model_dir

    args = ["--model", model or str(default_model_dir()), *serve_args]
    if record is not None:
        os.makedirs(record, exist_ok=True)
        args += ["--record", os.fspath(record)]
    with tempfile.TemporaryDirectory(prefix="sf-harness-") as tmp:
        if schedule is not None:
            from superfluid.daemon.worker import read_fault_schedule

            path = os.path.join(tmp, "faults.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(dict(schedule), f)
            read_fault_schedule(path)  # a bad schedule fails here, naming its field
            args += ["--fault-schedule", path]
        d = Daemon(name or f"harness{os.getpid()}x{next(_count)}", args, workers=1, fault_injection=True,
                   restart_backoff=0.05, restart_backoff_max=0.5, crash_loop=(20, 60.0), handle_signals=False,
                   tick_timeout=tick_timeout)
        d.start()
        loop = threading.Thread(target=d.serve_forever, name=f"daemon {d.name}", daemon=True)
        loop.start()
        try:
            with Client.connect(d.name, 0, timeout=120) as c:
                yield Harness(d, c, Planner(c, **dict(planner_options or {})))
        finally:
            d.stop()
            loop.join(60)


@pytest.fixture
def faulty_daemon_factory() -> Iterator[Any]:
    """faulty_daemon as a fixture: call it (same arguments) to get a Harness;
    every daemon it started stops when the test ends."""
    with contextlib.ExitStack() as stack:
        yield lambda *a, **kw: stack.enter_context(faulty_daemon(*a, **kw))
