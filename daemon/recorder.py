"""The flight recorder (`serve --record DIR`): everything a worker's executor
consumes, in order, in bounded files that `superfluid replay` re-runs
(docs/recorder.md).

The worker loop (worker_loop.py) tells the recorder each thing it hands the
executor — a session begun, an op, a plan (with the prompt-ring elements
its admits name, read here before the tick runs), op completions taken out
without a tick — and the outcome after (a tick's once its events are out:
packing it is no part of the planner's wait). What a call reads besides (the
executor's clock, the planner's yield and latency flags, state-directory
files) goes through wrappers installed here and rides in the outcome's
record. The executor knows nothing of files: it sees a TickRings, a clock
and a StateDir as before.

Each record is one os.write, no fsync: a worker killed by SIGKILL leaves
the page cache intact, so the record holds everything up to its last
write. A write that fails stops the recording (said once on stderr); the
worker goes on serving.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import superfluid
from superfluid.abi import ABI_VERSION
from superfluid.abi.records import OpCompletion, TickEvents, TickMemCounters
from superfluid.daemon import record_format as rf
from superfluid.executor import Executor, OpError, TickRings
from superfluid.rings.errors import RefError

FILES = 8  # a worker's record is about this many segment files at its bound
_packb = rf.pack
_frame = rf.frame
_crc = rf.zlib.crc32
_FRAME = rf.FRAME


class Capture:
    """What one executor call read besides its input, and wrote to the rings."""

    __slots__ = ("clock", "late", "latency", "logits", "state_dir", "tokens_at", "yields")

    def __init__(self, tokens_at: int = 0) -> None:
        self.clock: list[int] = []
        self.yields: list[bool] = []
        self.latency: list[bool] = []
        self.late: list[list[Any]] = []  # prompt reads no pre-read served
        self.state_dir: list[list[Any]] = []  # [call, ok, result or (status, message)]
        self.tokens_at = tokens_at  # where the token ring's next write started (DataRing.next_start)
        self.logits: list[list[Any]] = []  # [ref, blake2b-128 of the row's bytes] per write

    def reads(self) -> list[Any]:
        return [self.clock, self.yields, self.latency, self.late, self.state_dir]


def prompt_entry(ref, got: np.ndarray | RefError) -> list[Any]:
    """[ref, status, message, token bytes] of one prompt read."""
    if isinstance(got, RefError):
        msg = str(got)
        return [list(ref), int(got.status), msg, b""]
    return [list(ref), 0, "", got.tobytes()]


class RecordingRings(TickRings):
    """The worker's rings, as the executor sees them while recorded: prompt
    reads served from what the recorder read before the tick; flags and
    logits rows noted in the capture. (Token writes go straight to the
    ring: the recorder copies what the call wrote there in one piece.)"""

    def __init__(self, inner: TickRings, rec: Recorder):
        self.inner, self.rec = inner, rec
        self.prompt, self.tokens, self.logits = inner.prompt, inner.tokens, inner.logits
        self.served: dict[Any, np.ndarray | RefError] = {}

    def read_prompt(self, ref):  # type: ignore[no-untyped-def]
        got = self.served.get(ref)
        if got is None:
            try:
                got = self.inner.read_prompt(ref)
            except RefError as e:
                got = e
            self.rec.cap.late.append(prompt_entry(ref, got))
        if isinstance(got, RefError):
            raise got
        return got

    def write_logits(self, row):  # type: ignore[no-untyped-def]
        ref = self.inner.write_logits(row)
        data = np.ascontiguousarray(row, dtype="<f4").tobytes()
        self.rec.cap.logits.append([list(ref), hashlib.blake2b(data, digest_size=16).digest()])
        return ref

    def yield_requested(self) -> bool:
        v = self.inner.yield_requested()
        self.rec.cap.yields.append(v)
        return v

    def latency_wanted(self) -> bool:
        v = self.inner.latency_wanted()
        self.rec.cap.latency.append(v)
        return v


class RecordingStateDir:
    """The executor's StateDir, each call's outcome noted in the capture
    (an import's bytes included: a replay serves them, and writes nothing)."""

    def __init__(self, inner, rec: Recorder):  # type: ignore[no-untyped-def]
        self.inner, self.rec = inner, rec

    def _note(self, call: str, fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
        except OpError as e:
            self.rec.cap.state_dir.append([call, False, [int(e.status), str(e)]])
            raise
        self.rec.cap.state_dir.append([call, True, out])
        return out

    def check(self, path: object) -> Any:
        return self._note("check", lambda: self.inner.check(path))

    def read(self, path: object, cap: int) -> bytes:
        out: bytes = self._note("read", lambda: self.inner.read(path, cap))
        return out

    def write(self, path: object, data: bytes, *, overwrite: bool = False) -> None:
        self._note("write", lambda: self.inner.write(path, data, overwrite=overwrite))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class Recorder:
    """One worker process's recording: a new segment file per epoch (and
    when one grows past its share of --record-bytes), the oldest files of
    the worker's folder dropped to stay within it."""

    def __init__(self, root: str, index: int, *, max_bytes: int, epoch: int, argv: list[str],
                 model: str | None, state_bytes: int | None):
        self.dir = os.path.join(root, rf.WORKER_DIR.format(index))
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self.max_bytes = max_bytes
        self.file_bytes = max(4096, max_bytes // FILES)
        self.files = [(seq, p, os.path.getsize(p)) for seq, p in rf.segment_files(self.dir)]
        self.header: dict[str, Any] = {
            "format": rf.FORMAT_VERSION, "abi_version": ABI_VERSION, "superfluid": superfluid.__version__,
            "worker": index, "epoch": epoch, "argv": list(argv), "files": rf.option_files(argv),
            "model": {"path": model, "identity": rf.model_identity(model)},
            "state_bytes": state_bytes, "record_bytes": max_bytes, "pid": os.getpid(),
            "host": platform.node(), "python": platform.python_version(),
        }
        self.cap = Capture()
        self.rings: RecordingRings | None = None
        self.fd = -1
        self.written = 0  # bytes in the open file
        self.part = 0  # the open file's place in this epoch
        self.ticks = 0  # plans recorded in this epoch
        self.broken: str | None = None
        self._done: list[Any] | None = None  # the last tick's outcome, until flush_done writes it

    # ------------------------------------------------------------- files

    def attach(self, ex: Executor) -> None:
        """Wrap the executor's rings, clock and state directory; write the
        epoch's header (the rings' positions, the event capacity: as the
        worker set them up)."""
        rings = RecordingRings(ex.rings, self)
        self.header.update(
            runtime=dataclasses.asdict(ex.desc), event_capacity=ex.event_capacity,
            rings={"tokens": [ex.rings.tokens.capacity, ex.rings.tokens.next_start()],
                   "logits": [ex.rings.logits.capacity, ex.rings.logits.next_start()]},
            started_ns=time.time_ns())
        ex.rings = self.rings = rings
        inner_clock, rec = ex.clock, self

        def clock() -> int:
            v = inner_clock()
            rec.cap.clock.append(v)
            return v

        ex.clock = clock
        if ex.state_dir is not None:
            ex.state_dir = RecordingStateDir(ex.state_dir, self)  # type: ignore[assignment]
        self._open()

    def _open(self) -> None:
        seq = self.files[-1][0] + 1 if self.files else 0
        # Room for the file about to start: the oldest go first (the open one never).
        total = sum(size for _, _, size in self.files)
        while self.files and total + self.file_bytes > self.max_bytes:
            _, old, size = self.files.pop(0)
            total -= size
            try:
                os.unlink(old)
            except FileNotFoundError:
                pass
        path = os.path.join(self.dir, rf.segment_name(seq))
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self.files.append((seq, path, 0))
        self.written = 0
        head = dict(self.header, part=self.part, ticks_before=self.ticks)
        self._write(rf.MAGIC + _frame(rf.HEADER, _packb(head)))

    def _write(self, data: bytes) -> None:
        if self.broken is not None:
            return
        try:
            view = memoryview(data)
            while view:
                n = os.write(self.fd, view)
                view = view[n:]
        except OSError as e:
            self._stop(f"a write failed ({e.strerror})")
            return
        self.written += len(data)
        seq, path, _ = self.files[-1]
        self.files[-1] = (seq, path, self.written)

    def _put(self, kind: int, body: Any) -> None:
        if self.broken is not None:
            return
        try:
            payload = bytes((kind,)) + _packb(body)
        except Exception as e:  # never the worker's end: the record's
            self._stop(f"a {rf.KINDS[kind]} record could not be written ({type(e).__name__}: {e})")
            return
        self._write(_FRAME.pack(len(payload), _crc(payload)) + payload)

    def _stop(self, why: str) -> None:
        self.broken = why
        print(f"superfluid worker: the record in {self.dir} stops here: {why}", file=sys.stderr)

    def _between(self) -> None:
        """After a whole exchange: start the next file when this one is full."""
        if self.written >= self.file_bytes and self.broken is None:
            os.close(self.fd)
            self.part += 1
            try:
                self._open()
            except OSError as e:
                self._stop(f"the next file could not be made ({e})")

    def close(self) -> None:
        self.flush_done()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # ----------------------------------------------------------- records

    def session(self, session: int) -> None:
        self.flush_done()
        self._put(rf.SESSION, [session])
        self._between()

    def flush(self) -> None:
        self.flush_done()
        self._put(rf.FLUSH, [])
        self._between()

    def _capture(self) -> None:
        assert self.rings is not None
        self.cap = Capture(self.rings.tokens.next_start())

    def op(self, payload: bytes) -> None:
        self.flush_done()
        self._capture()
        self._put(rf.OP, [payload])

    def op_done(self, done: OpCompletion) -> None:
        self._put(rf.OP_DONE, [done, self.cap.reads()])
        self._between()

    def plan(self, message: bytes, try_empty: bool, prompts: list[list[Any]]) -> None:
        """A plan's message and the prompt reads its admits need, before its tick."""
        self.flush_done()
        self._capture()
        self.ticks += 1
        self._put(rf.PLAN, [message, try_empty, prompts])

    def plan_decoded(self, message: bytes, plan) -> None:  # type: ignore[no-untyped-def]
        """plan() for a decoded plan: its admits' prompts read now, and
        served to the tick from here (so the tick sees what is recorded)."""
        served: dict[Any, np.ndarray | RefError] = {}
        prompts = []
        if plan.admits:
            assert self.rings is not None
            inner = self.rings.inner
            for a in plan.admits:
                ref = a.prompt
                if ref in served:
                    continue
                try:
                    got: np.ndarray | RefError = inner.read_prompt(ref)
                except RefError as e:
                    got = e
                served[ref] = got
                prompts.append(prompt_entry(ref, got))
        if self.rings is not None:
            self.rings.served = served
        self.plan(message, False, prompts)

    def done(self, path: int, outcome: TickEvents | TickMemCounters) -> None:
        """The tick's outcome: its events (or, answered by tick_empty, its
        memory record). Written by flush_done, which the worker calls once
        the events are out (packing them is then no part of the planner's
        wait), and every other record first."""
        assert self.rings is not None
        self.rings.served = {}
        cap = self.cap
        self._done = [path, outcome, cap.reads(), [cap.tokens_at, self.rings.tokens.next_start()], cap.logits]

    def flush_done(self) -> None:
        d = self._done
        if d is None:
            return
        self._done = None
        assert self.rings is not None
        start, end = d[3]
        d[3] = [start, self.rings.tokens.span_bytes(start, end)]  # (only this worker writes there)
        self._put(rf.DONE, d)
        self._between()

