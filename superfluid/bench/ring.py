"""`superfluid bench ring`: the transport's cost, plan in and events out.

A client sends an empty TickPlan to a server process and waits for its
TickEvents, over the shared-memory queues, a unix socket and a pair of pipes.
All three carry the same bytes and do the same codec work (the plan encoded
by PlanBuilder, decoded by abi.plan_codec.decode_plan; events encoded by
encode_events_into, decoded by decode_events); only the transport differs.
They run in interleaved blocks so that drift in the machine hits all alike.

Also measured: the same round trips with pre-encoded bytes and no codec
("raw", the transport alone), the codec alone in one process, the
one-way rate of plan messages through the plan queue, and (ring_worker.py)
empty ticks through a real worker (`superfluid serve --fake`) from Python
and from Rust, with the worker's own tick (TickTimings.wall_ns).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import numpy as np

from superfluid.abi.plan_codec import decode_events, decode_plan, encode_events_into
from superfluid.bench import ring_worker
from superfluid.bench.ring_rpc import (
    _CMD_CODEC,
    _CMD_EXIT,
    _CMD_FLOOD,
    _CMD_FLOOD_END,
    _CMD_RAW,
    _OK,
    _PLAN_BLOB,
    _POLL_S,
    _SEQ_AT,
    _U64,
    BenchError,
    _command,
    _End,
    _events,
    _pipe_end,
    _ShmEnd,
    _socket_end,
    _spawn,
)
from superfluid.client import PlanBuilder
from superfluid.rings.queue import DEFAULT_SPIN_NS, QueueTimeout
from superfluid.rings.segment import Segment

TRANSPORTS = ("shm", "unix_socket", "pipe")

_BLOCK_WARMUP = 50


# ------------------------------------------------------------------ client


def _round_trips(end: _End, n: int, raw: bool, seq: int) -> tuple[list[int], int]:
    """n round trips from plan_seq seq + 1; (latencies in ns, last seq)."""
    clock = time.perf_counter_ns
    lat: list[int] = []
    append = lat.append
    if raw:
        blob = _PLAN_BLOB
        k = len(blob)
        for _ in range(n):
            seq += 1
            t0 = clock()
            out = end.out()
            out[:k] = blob
            _U64.pack_into(out, _SEQ_AT, seq)
            end.send(k)
            got = _U64.unpack_from(end.recv(), _SEQ_AT)[0]
            end.done()
            t1 = clock()
            if got != seq:
                raise BenchError(f"sent plan_seq {seq}, the answer says {got}")
            append(t1 - t0)
    else:
        for _ in range(n):
            seq += 1
            t0 = clock()
            end.send(PlanBuilder(seq).encode_into(end.out()))
            ev = decode_events(end.recv())
            end.done()
            t1 = clock()
            if ev.plan_seq != seq or ev.status != _OK:
                raise BenchError(f"sent plan_seq {seq}, got events for {ev.plan_seq} with status {ev.status}")
            append(t1 - t0)
    return lat, seq


def _interleaved(ends: dict[str, _End], seqs: dict[str, int], rounds: int, blocks: int,
                 raw: bool) -> dict[str, list[int]]:
    """rounds round trips per transport in blocks, the order rotating each
    block; a few unrecorded trips first wake a server that idled meanwhile."""
    names = list(ends)
    lat: dict[str, list[int]] = {name: [] for name in names}
    for b in range(blocks):
        n = rounds // blocks + (b < rounds % blocks)
        r = b % len(names)
        for name in names[r:] + names[:r]:
            _, seqs[name] = _round_trips(ends[name], _BLOCK_WARMUP, raw, seqs[name])
            got, seqs[name] = _round_trips(ends[name], n, raw, seqs[name])
            lat[name] += got
    return lat


def _flood(seg: Segment, end: _End, seconds: float, max_msgs: int, spin_ns: int,
           alive: Callable[[], None]) -> tuple[int, float]:
    """Plans one way through the plan queue for `seconds` (at most max_msgs):
    a pre-encoded plan copied into each slot, plan_seq patched; the server
    reads plan_seq and releases. (messages, seconds) until the server has
    consumed all of them."""
    _command(end, _CMD_FLOOD)
    q = seg.plan_queue
    blob = _PLAN_BLOB
    k = len(blob)
    clock = time.perf_counter_ns
    sent = 0
    t0 = clock()
    deadline = t0 + int(seconds * 1e9)
    while sent < max_msgs:
        slot = q.try_reserve()
        if slot is None:
            try:
                q.wait_writable(_POLL_S, spin_ns=spin_ns)
            except QueueTimeout:
                alive()
            continue
        slot[:k] = blob
        sent += 1
        _U64.pack_into(slot, _SEQ_AT, sent)
        q.publish()
        if not sent & 1023 and clock() >= deadline:
            break
    consumed = _command(end, _CMD_FLOOD_END)
    t1 = clock()
    if consumed != sent:
        raise BenchError(f"sent {sent} plans, the server consumed {consumed}")
    return sent, (t1 - t0) / 1e9


def _codec_costs(n: int) -> dict[str, float]:
    """Median µs of each codec step in this process, no transport."""
    buf = bytearray(4096)
    steps: dict[str, Callable[[], Any]] = {
        "encode_plan": lambda: PlanBuilder(1).encode_into(buf),
        "decode_plan": lambda: decode_plan(buf),
        "encode_events": lambda: encode_events_into(buf, _events(1)),
        "decode_events": lambda: decode_events(buf),
    }
    clock = time.perf_counter_ns
    out: dict[str, float] = {}
    for name, fn in steps.items():
        for _ in range(n // 4 + 1):
            fn()
        lat = []
        for _ in range(n):
            t0 = clock()
            fn()
            lat.append(clock() - t0)
        out[name] = round(float(np.median(lat)) / 1e3, 2)
    out["total"] = round(sum(out.values()), 2)
    return out


def _stats(ns: list[int]) -> dict[str, float]:
    p50, p99 = np.percentile(np.asarray(ns, dtype=np.float64) / 1e3, [50, 99])
    return {"p50": round(float(p50), 2), "p99": round(float(p99), 2)}


def _alive(name: str, proc: subprocess.Popen[bytes]) -> Callable[[], None]:
    def check() -> None:
        if proc.poll() is not None:
            raise BenchError(f"the {name} server exited with status {proc.returncode}")

    return check


def _reap(ends: dict[str, _End], procs: list[subprocess.Popen[bytes]]) -> None:
    for end in ends.values():
        if isinstance(end, _ShmEnd) and not end.has_room():
            continue  # a stuck server; killed below rather than waited for
        try:
            _command(end, _CMD_EXIT)
        except (BenchError, OSError):  # a dead server; reaped below
            pass
    for p in procs:
        try:
            p.wait(5.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _pick_cpus(pin: bool) -> tuple[int, int] | None:
    """(client CPU, server CPU): two of the CPUs we may use, or None."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None
    allowed = sorted(os.sched_getaffinity(0))
    return (allowed[0], allowed[1]) if len(allowed) >= 2 else None


def _measure(rounds: int, warmup: int, blocks: int, seconds: float, max_msgs: int, spin_ns: int,
             server_cpu: int | None) -> tuple[dict[str, list[int]], dict[str, list[int]], int, float]:
    """(codec latencies, raw latencies, plans flooded, seconds of the flood)."""
    ends: dict[str, _End] = {}
    procs: list[subprocess.Popen[bytes]] = []
    with ExitStack() as stack:
        seg = Segment.create(f"bench-{os.getpid()}-{secrets.token_hex(3)}")
        # LIFO: the servers are reaped first, then our fds closed (not before:
        # a closed fd number could be reused), then the segment unmapped and
        # unlinked.
        stack.callback(seg.unlink)
        stack.callback(seg.close)
        sock, sock_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        stack.enter_context(sock)
        stack.enter_context(sock_theirs)
        # File objects, so that closing twice is harmless (a raw fd number
        # closed twice could by then name something else).
        fds = (*os.pipe(), *os.pipe())
        c2s_r, c2s_w, s2c_r, s2c_w = (stack.enter_context(os.fdopen(fd, mode, buffering=0))
                                      for fd, mode in zip(fds, ("rb", "wb") * 2, strict=True))
        stack.callback(_reap, ends, procs)

        procs.append(_spawn("shm", seg.path, spin_ns, cpu=server_cpu))
        shm_alive = _alive("shm", procs[-1])
        ends["shm"] = _ShmEnd(seg.event_queue, seg.plan_queue, shm_alive, spin_ns)
        fd = sock_theirs.fileno()
        procs.append(_spawn("unix_socket", fd, cpu=server_cpu, pass_fds=(fd,)))
        theirs = (c2s_r.fileno(), s2c_w.fileno())
        procs.append(_spawn("pipe", *theirs, cpu=server_cpu, pass_fds=theirs))
        # The children hold their ends now; ours must go so that a dead child
        # shows as EOF.
        sock_theirs.close()
        c2s_r.close()
        s2c_w.close()
        ends["unix_socket"] = _socket_end(sock)
        ends["pipe"] = _pipe_end(s2c_r.fileno(), c2s_w.fileno())

        seqs = dict.fromkeys(ends, 0)
        for name, end in ends.items():
            _, seqs[name] = _round_trips(end, warmup, False, seqs[name])
        lat = _interleaved(ends, seqs, rounds, blocks, raw=False)

        for end in ends.values():
            _command(end, _CMD_RAW)
        raw_lat = _interleaved(ends, seqs, rounds, blocks, raw=True)
        for end in ends.values():
            _command(end, _CMD_CODEC)

        n_msgs, flood_s = _flood(seg, ends["shm"], seconds, max_msgs, spin_ns, shm_alive)
    return lat, raw_lat, n_msgs, flood_s


def run(rounds: int = 10_000, *, warmup: int = 1_000, blocks: int = 10, seconds: float = 1.0,
        max_msgs: int = 10_000_000, spin_ns: int = DEFAULT_SPIN_NS, pin: bool = True,
        codec_rounds: int = 2_000, worker_rounds: int = 10_000, rust: bool = True) -> dict[str, Any]:
    """Run the benchmark; the result as a JSON-able dict. `pin`: the client
    (this thread) on one CPU and the servers on another, when there are two;
    left to the scheduler, a spinning waiter may share a CPU with its peer
    and hold it off until the spin runs out. `worker_rounds`: empty ticks
    through a real worker from each of Python and Rust (0: none); `rust`:
    the Rust row too."""
    if rounds < 1 or blocks < 1 or warmup < 0 or seconds <= 0 or max_msgs < 1 or worker_rounds < 0:
        raise ValueError("rounds, blocks and max_msgs must be >= 1, warmup and worker_rounds >= 0, seconds > 0")
    blocks = min(blocks, rounds)
    started = time.perf_counter()
    load = os.getloadavg()[0]
    cpus = _pick_cpus(pin)
    mask = os.sched_getaffinity(0) if cpus else None
    try:
        if cpus:
            os.sched_setaffinity(0, {cpus[0]})
        lat, raw_lat, n_msgs, flood_s = _measure(rounds, warmup, blocks, seconds, max_msgs, spin_ns,
                                                 cpus[1] if cpus else None)
        codec_us = _codec_costs(codec_rounds)
        worker = (ring_worker.run(worker_rounds, warmup, rust=rust, client_cpu=cpus[0] if cpus else None,
                                  worker_cpu=cpus[1] if cpus else None) if worker_rounds else None)
    finally:
        if mask is not None:
            os.sched_setaffinity(0, mask)
    stats = {name: _stats(v) for name, v in lat.items()}
    return {
        "shm_rtt_us": stats["shm"],
        "unix_socket_rtt_us": stats["unix_socket"],
        "pipe_rtt_us": stats["pipe"],
        "shm_msgs_per_s": round(n_msgs / flood_s, 1),
        "ratio_shm_to_unix_p50": round(stats["shm"]["p50"] / stats["unix_socket"]["p50"], 3),
        "ratio_shm_to_pipe_p50": round(stats["shm"]["p50"] / stats["pipe"]["p50"], 3),
        # The same round trips with pre-encoded bytes: the transport alone.
        "raw_rtt_us": {name: _stats(v) for name, v in raw_lat.items()},
        # The codec steps of one round trip, in one process.
        "codec_us": codec_us,
        # Empty ticks through a real worker (superfluid serve --fake): µs, as a planner sees them.
        **(worker or ring_worker.skipped("worker_rounds = 0")),
        "n_round_trips": rounds,
        "warmup": warmup,
        "blocks": blocks,
        "spin_us": spin_ns / 1e3,
        "pinned_cpus": {"client": cpus[0], "servers": cpus[1]} if cpus else None,
        "shm_msgs": n_msgs,
        "shm_msgs_seconds": round(flood_s, 3),
        # Other work on the machine: with spinning waiters it shows in shm first.
        "loadavg_1m_before": round(load, 2),
        "python": platform.python_version(),
        "implementation": sys.implementation.name,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "wall_s": round(time.perf_counter() - started, 2),
    }


# ---------------------------------------------------------------------- CLI


def _table(r: dict[str, Any]) -> str:
    c = r["codec_us"]
    cpus = r["pinned_cpus"]
    pinned = f"client on CPU {cpus['client']}, servers on CPU {cpus['servers']}" if cpus else "not pinned"
    lines = [f"{'transport':<12} {'p50 µs':>9} {'p99 µs':>9} {'raw p50':>9} {'raw p99':>9}"]
    for name in TRANSPORTS:
        s, raw = r[f"{name}_rtt_us"], r["raw_rtt_us"][name]
        lines.append(f"{name:<12} {s['p50']:>9.2f} {s['p99']:>9.2f} {raw['p50']:>9.2f} {raw['p99']:>9.2f}")
    lines.append(f"p50 ratio shm / unix socket: {r['ratio_shm_to_unix_p50']:.3f},"
                 f" shm / pipe: {r['ratio_shm_to_pipe_p50']:.3f}")
    lines.append(f"shm plan queue: {r['shm_msgs_per_s']:,.0f} msgs/s"
                 f" ({r['shm_msgs']:,} in {r['shm_msgs_seconds']} s)")
    lines.append(f"codec per round trip (one process): {c['total']:.2f} µs"
                 f" = encode plan {c['encode_plan']:.2f}"
                 f" + decode plan {c['decode_plan']:.2f} + encode events {c['encode_events']:.2f}"
                 f" + decode events {c['decode_events']:.2f}")
    if r["worker_rounds"]:
        rust = (f"Rust p50 {r['worker_rt_rust_p50_us']:.2f} µs (p99 {r['worker_rt_rust_p99_us']:.2f}, worker tick"
                f" {r['worker_tick_wall_rust_p50_us']:.2f})" if r["worker_rt_rust_p50_us"] is not None
                else f"Rust skipped: {r['worker_rust_skipped']}")
        lines.append(f"empty tick through a real worker ({r['worker_rounds']} each): Python p50"
                     f" {r['worker_rt_python_p50_us']:.2f} µs (p99 {r['worker_rt_python_p99_us']:.2f}, worker tick"
                     f" {r['worker_tick_wall_p50_us']:.2f}); {rust}")
    lines.append(f"{r['n_round_trips']} round trips per transport in {r['blocks']} interleaved blocks,"
                 f" spin {r['spin_us']:g} µs, {pinned}; Python {r['python']}, {r['cpu_count']} CPUs,"
                 f" load {r['loadavg_1m_before']}, {r['wall_s']} s")
    return "\n".join(lines)


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{s}: must be >= 1")
    return v


def _nonnegative_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"{s}: must be >= 0")
    return v


def _positive_float(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{s}: must be > 0")
    return v


def _main(args: argparse.Namespace) -> int:
    try:
        result = run(args.rounds, warmup=args.warmup, blocks=args.blocks, seconds=args.seconds,
                     spin_ns=int(args.spin_us * 1e3), pin=args.pin, worker_rounds=args.worker_rounds,
                     rust=args.rust)
    except (BenchError, ring_worker.WorkerBenchError) as e:
        print(f"superfluid bench ring: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if args.json else _table(result))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "ring", help="plan/events round trip: shared-memory queues vs unix socket vs pipe",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--rounds", type=_positive_int, default=10_000,
                   help="round trips per transport (default 10000)")
    p.add_argument("--warmup", type=_nonnegative_int, default=1_000,
                   help="unrecorded round trips first (default 1000)")
    p.add_argument("--blocks", type=_positive_int, default=10, help="interleaved blocks (default 10)")
    p.add_argument("--seconds", type=_positive_float, default=1.0,
                   help="length of the plan-queue throughput run (default 1.0)")
    p.add_argument("--spin-us", type=float, default=DEFAULT_SPIN_NS / 1e3,
                   help=f"queue waits spin this long before the futex (default {DEFAULT_SPIN_NS / 1e3:g})")
    p.add_argument("--worker-rounds", type=_nonnegative_int, default=10_000,
                   help="empty ticks through a real worker, from Python and from Rust (default 10000, 0 = none)")
    p.add_argument("--no-rust", dest="rust", action="store_false",
                   help="no Rust row (default: build client/rust's superfluid-bench with cargo, offline)")
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="leave CPU placement to the scheduler (default: client and servers on two CPUs)")
    p.set_defaults(func=_main)
