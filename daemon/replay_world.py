"""The world a replayed executor sees (replay.py, docs/recorder.md): the
worker's options, and stand-ins for what its executor read besides its
input, each answering as the record says the worker's did.

ReplayRings serves the prompt elements a plan's admits read and the
planner's flags as the tick read them, and writes into private token and
logits rings that start where the worker's stood; ReplayClock gives the
recorded clock readings (the speculation gate and the prefill step size
decide on them); ReplayStateDir answers as the worker's state directory
did, and writes nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import numpy as np

from superfluid.abi import OpStatus, Status
from superfluid.abi.plan_codec import PlanReject, decode_plan, empty_plan, plan_seq_of
from superfluid.abi.records import RingRef
from superfluid.daemon import record_format as rf
from superfluid.daemon.replay_diff import Writes
from superfluid.executor import LocalRings, OpError, TickRings
from superfluid.rings.errors import RefError


class Refused(Exception):
    """A record this replay will not run (one line, naming the file and field)."""


class ReplayRings(TickRings):
    """The rings and flags as the recorded calls found them; feed() before each call."""

    def __init__(self, rings: dict[str, list[int]]):
        (tok_cap, tok_at), (log_cap, log_at) = rings["tokens"], rings["logits"]
        local = LocalRings(prompt_tokens=1, emit_tokens=tok_cap, logits_floats=log_cap)
        self.prompt, self.tokens, self.logits = local.prompt, local.tokens, local.logits
        self.tokens.start_at(tok_at)
        self.logits.start_at(log_at)
        self.capacity = tok_cap
        self.served: dict[RingRef, list[Any]] = {}
        self.yields: list[bool] = []
        self.latency: list[bool] = []
        self.writes = Writes()
        self.overrun: list[str] = []  # reads past what was recorded

    def feed(self, prompts: list[list[Any]], reads: list[Any]) -> None:
        self.served = {RingRef(*e[0]): e for e in (*prompts, *reads[3])}
        self.yields, self.latency = list(reads[1]), list(reads[2])
        self.writes = Writes(self.capacity, self.tokens.next_start())
        self.overrun = []

    def written(self) -> Writes:
        """What the call wrote, since feed()."""
        w = self.writes
        w.tokens = self.tokens.span_bytes(w.start, self.tokens.next_start())
        return w

    def read_prompt(self, ref: RingRef) -> np.ndarray:
        e = self.served.get(RingRef(*ref))
        if e is None:
            self.overrun.append(f"a prompt read of {tuple(ref)}")
            raise RefError(Status.RejectBadRefGeneration, ref, "not in the record")
        if e[1]:
            err = RefError(e[1], ref, "")
            err.args = (e[2],)  # the recorded message, whole
            raise err
        return np.frombuffer(e[3], dtype="<u4").copy()

    def write_logits(self, row: np.ndarray) -> RingRef:
        ref = self.logits.write(row)
        data = np.ascontiguousarray(row, dtype="<f4").tobytes()
        self.writes.logits[tuple(ref)] = hashlib.blake2b(data, digest_size=16).digest()
        return ref

    def _flag(self, vals: list[bool], name: str) -> bool:
        if not vals:
            self.overrun.append(f"a read of {name}")
            return False
        return vals.pop(0)

    def yield_requested(self) -> bool:
        return self._flag(self.yields, "yield_requested")

    def latency_wanted(self) -> bool:
        return self._flag(self.latency, "latency_wanted")


class ReplayClock:
    """The executor's clock: the recorded readings of the call, in order."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.at = 0
        self.over = 0

    def feed(self, values: list[int]) -> None:
        self.values, self.at, self.over = values, 0, 0

    def __call__(self) -> int:
        if self.at < len(self.values):
            self.at += 1
            return self.values[self.at - 1]
        self.over += 1
        return self.values[-1] if self.values else 0


class ReplayStateDir:
    """The worker's state directory as its calls found it: each answer recorded."""

    def __init__(self, max_bytes: int | None):
        self.max_bytes = max_bytes
        self.calls: list[list[Any]] = []
        self.overrun: list[str] = []

    def _next(self, call: str) -> Any:
        if not self.calls or self.calls[0][0] != call:
            self.overrun.append(f"a state-directory {call}")
            raise OpError(OpStatus.BadRequest, f"replay: a {call} the record does not hold")
        _, ok, out = self.calls.pop(0)
        if not ok:
            raise OpError(OpStatus(out[0]), out[1])
        return out

    def check(self, path: object) -> Any:
        return self._next("check")

    def read(self, path: object, cap: int) -> bytes:
        out: bytes = self._next("read")
        return out

    def write(self, path: object, data: bytes, *, overwrite: bool = False) -> None:
        self._next("write")

    def held_bytes(self) -> int:
        return 0


# --------------------------------------------------------------- set-up


def worker_args(header: dict[str, Any], model: str | None, tmp: str) -> argparse.Namespace:
    """The recorded worker's options, parsed as the worker parsed them, with
    what pointed at this machine's moment replaced: the model (--model), the
    state directory (a private empty one), the files FILE_OPTIONS name
    (their recorded bytes), the tensor-parallel rendezvous (none: the ranks
    start here)."""
    from superfluid.daemon.worker import worker_parser

    p = worker_parser()

    def refuse(message: str) -> None:
        raise Refused(f"argv: the recorded worker options do not parse here: {message}")

    p.error = refuse  # type: ignore[method-assign,assignment]
    args = p.parse_args(header["argv"])
    if model is not None and not args.fake:
        args.model = model
    elif header["model"]["path"] is not None:
        args.model = header["model"]["path"]
    if args.state_dir is not None:
        args.state_dir = os.path.join(tmp, "state")
    for opt, data in header.get("files", {}).items():
        dest = opt.lstrip("-").replace("-", "_")
        path = os.path.join(tmp, dest)
        with open(path, "wb") as f:
            f.write(data)
        setattr(args, dest, path)
    args.tp_init = args.tp_shm = None
    args.nnodes, args.node_rank = 1, 0
    args.record = None
    args.fake_step_cost = 0.0  # the fake's simulated cost: time, which the recorded clock stands for
    return args


def _desc_difference(recorded: dict[str, Any], desc: Any) -> str | None:
    here = dataclasses.asdict(desc)
    for k, v in recorded.items():
        # The layout and the ISA change no bit; the numeric class does (a replay in another one is refused).
        if k not in ("tp", "nnodes", "isa") and here.get(k) != v:
            hint = ""
            if k == "numeric_class" and str(v).startswith("bf16-"):
                hint = f" (SUPERFLUID_BF16_CLASS={v} replays in the recorded class)"
            return f"runtime.{k}: recorded {v!r}, here {here.get(k)!r}{hint}"
    return None


@dataclass
class Started:
    ex: Any
    rings: ReplayRings
    clock: ReplayClock
    state_dir: ReplayStateDir | None
    runtime: Any


def start(h: dict[str, Any], first_file: str, model: str | None, tmp: str) -> Started:
    """A fresh executor for the epoch whose header is `h`, as its worker made one."""
    from superfluid.daemon.worker import build_runtime, make_executor

    args = worker_args(h, model, tmp)
    try:
        runtime = build_runtime(args)
    except Exception as e:  # (the model's identity matched: its files, or this machine, would not load it)
        raise Refused(f"{first_file}: the recorded runtime would not load here: {type(e).__name__}: {e}") from None
    diff = _desc_difference(h["runtime"], runtime.desc)
    if diff:
        runtime.close()
        raise Refused(f"{first_file}: {diff}")
    rings = ReplayRings(h["rings"])
    ex = make_executor(args, runtime, rings, epoch=h["epoch"], fatal_exit=False, state_bytes=h["state_bytes"])
    ex.event_capacity = h["event_capacity"]
    if ex.fault_rt is not None:
        ex.fault_rt.sleep = lambda s: None  # a schedule's stalls and slow steps change only timings
    ex.partial_sink = lambda *_: None  # the worker's sends partial emits to its stream queue
    clock = ReplayClock()
    ex.clock = clock
    sd = None
    if ex.state_dir is not None:
        sd = ReplayStateDir(h["state_bytes"])
        ex.state_dir = sd
    return Started(ex, rings, clock, sd, runtime)


def new_tmp() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="sf-replay-")


def run_plan(s: Started, message: bytes, try_empty: bool) -> tuple[int, Any]:
    """(path, outcome) of a plan, taken as the worker takes it (worker_loop.Worker._plan)."""
    from superfluid.daemon.worker_loop import run_empty

    ex = s.ex
    if try_empty:
        head = empty_plan(message)
        got = run_empty(ex, head) if head is not None else None
        if got is not None:
            return rf.PATH_EMPTY, got[0]
    try:
        plan = decode_plan(message)
    except PlanReject as r:
        return rf.PATH_UNDECODED, ex.reject(plan_seq_of(message), r).events
    return rf.PATH_TICK, ex.tick(plan, decoded=True).events

