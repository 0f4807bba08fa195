"""A hostile planner against a live daemon (contract §10, issue 11).

Whatever a planner writes into a segment (header fields, queue counters and
geometry, slots, ring headers and data) must not make the worker exit, make
the daemon give it up, or make the daemon exit; a corrupted queue is reset
and reported (QueueReset); no session ever gets a reply to another session's
plan or op. tests/daemon/test_planner_boundary.py has the first attacks;
these are the next ones. After each: the worker's pid is unchanged (unless
the test killed it), status says READY, the daemon runs, a fresh Client ticks.
"""

from __future__ import annotations

import os
import random
import re
import struct
import subprocess
import threading
import time

import msgpack
import numpy as np
import pytest

from superfluid.abi import MAGIC, MsgKind, OpStatus, QueueKind, Sampling, Status, codec, ffi, lib
from superfluid.cli import main as cli_main
from superfluid.client import Client, PlanBuilder
from superfluid.client.planner import Planner
from superfluid.client.session import ClientError, ClientTimeout
from superfluid.daemon.status import format_status, read_status
from superfluid.rings.errors import SegmentError
from superfluid.rings.naming import shm_dir
from superfluid.rings.segment import Segment
from superfluid.testing.daemon import FAKE, WAIT_S, Serve, start_fake, state_of, wait_for
from superfluid.testing.launch import python

QUEUES = ("plan", "event", "op", "stream")
RINGS = ("prompt", "token", "logits")
U64 = (1 << 64) - 1
U32 = (1 << 32) - 1


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Serve:
    s = start_fake(tmp_path_factory, "ht")
    try:
        with Segment.open(s.name, 0) as seg:  # the layout as the daemon made it
            s.layout = {k: int(getattr(seg.header.layout, k)) for k in
                        [f"{q}_queue" for q in QUEUES] + [f"{r}_ring" for r in RINGS]}
            s.geometry = {q: (seg.queues[q].n_slots, seg.queues[q].slot_bytes) for q in QUEUES}
            s.capacity = {r: seg.rings[r].capacity for r in RINGS}
            s.identity = bytes(ffi.buffer(seg.header, ffi.offsetof("SegmentHeader", "worker_epoch")))
            s.daemon_pid = int(seg.header.daemon_pid)
        yield s
    finally:
        s.close()


# ---------------------------------------------------------------- helpers


def connect(d: Serve, timeout: float = WAIT_S, **kw) -> Client:
    return Client.connect(d.name, 0, timeout=timeout, **kw)


def hostile(d: Serve) -> Segment:
    """The segment as any process of the daemon's user maps it: no lock, no session."""
    return Segment.open(d.name, 0)


class Raw:
    """A raw mapping of the segment file: no checks at all (works whatever the header says)."""

    def __init__(self, d: Serve):
        import mmap

        self.d = d
        self.fd = os.open(os.path.join(shm_dir(), f"superfluid.{d.name}.0"), os.O_RDWR)
        self.mm = mmap.mmap(self.fd, 0)
        self.base = ffi.from_buffer(self.mm)
        self.h = ffi.cast("SegmentHeader *", self.base)
        self._views: list[memoryview] = []

    def queue(self, q: str):
        return ffi.cast("Queue *", self.base + self.d.layout[f"{q}_queue"])

    def ring(self, r: str):
        return ffi.cast("DataRing *", self.base + self.d.layout[f"{r}_ring"])

    def slot(self, q: str, i: int) -> memoryview:
        n, sb = self.d.geometry[q]
        at = self.d.layout[f"{q}_queue"] + ffi.sizeof("Queue") + (i % n) * sb
        mv = memoryview(self.mm)[at:at + sb]
        self._views.append(mv)
        return mv

    def head(self, q: str) -> int:
        return lib.sf_load_acquire_u64(ffi.addressof(self.queue(q), "head"))

    def tail(self, q: str) -> int:
        return lib.sf_load_acquire_u64(ffi.addressof(self.queue(q), "tail"))

    def set_head(self, q: str, v: int) -> None:
        lib.sf_store_release_u64(ffi.addressof(self.queue(q), "head"), v & U64)

    def set_tail(self, q: str, v: int) -> None:
        lib.sf_store_release_u64(ffi.addressof(self.queue(q), "tail"), v & U64)

    def write(self, offset: int, data: bytes) -> None:
        self.mm[offset:offset + len(data)] = data

    def sessions_after(self, before: int) -> None:
        """session_id back to a small value above every session so far (the
        cleanup of a test that wrote it: a huge one breaks every later
        planner's lane tags, a smaller one hands out used ids)."""
        lib.sf_store_release_u64(ffi.addressof(self.h, "session_id"), before + 1000)

    def restore_identity(self) -> None:
        """Line 0 and daemon_pid as the daemon made them (the cleanup of a test
        that left them scribbled: nothing running puts them back)."""
        self.write(8, self.d.identity[8:])
        self.h.daemon_pid = self.d.daemon_pid
        lib.sf_store_release_u64(ffi.addressof(self.h, "magic"), MAGIC)

    def close(self) -> None:
        for mv in self._views:
            mv.release()
        ffi.release(self.base)
        self.mm.close()
        os.close(self.fd)

    def __enter__(self) -> Raw:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Mark:
    """What the daemon logged since a point: worker exits, repairs."""

    def __init__(self, d: Serve):
        self.d = d
        self.at = len(d.log)

    @property
    def text(self) -> str:
        return self.d.log[self.at:]

    def brief(self) -> str:
        """The log since the mark less the repair/reset chatter: exits, tracebacks."""
        return "\n".join(ln for ln in self.text.splitlines() if "reset both" not in ln and "repaired" not in ln)[-4000:]

    def exits(self) -> list[str]:
        return re.findall(r"^.*worker 0 \(pid \d+, epoch \d+\) .*$", self.text, re.M)


def fresh_tick(d: Serve, timeout: float = WAIT_S) -> int:
    """A fresh Client connects and ticks OK; the worker's pid."""
    with connect(d, timeout) as c:
        ev = c.tick(PlanBuilder(0), timeout=timeout)
        assert ev.status == Status.OK, ev
        return int(c.seg.header.worker_pid)


def healthy(d: Serve, mark: Mark, pid: int | None, *, restarts: int = 0) -> int:
    """The promise after an attack: daemon running, worker READY (the same
    process unless `restarts` were allowed), a fresh Client ticks OK."""
    assert d.proc.poll() is None, mark.brief()
    wait_for(lambda: (state_of(d.name) or {}).get("state") == "READY", "worker READY (status readable)", 10)
    now = fresh_tick(d)
    st = read_status(d.name)
    assert st["daemon_running"] and st["workers"][0]["state"] == "READY", st
    exits = mark.exits()
    if restarts == 0:
        assert now == pid and not exits, mark.brief()
    else:
        assert len(exits) <= restarts, mark.brief()
    assert "giving up on it" not in mark.text, mark.text
    return now


def worker_pid(d: Serve) -> int:
    return fresh_tick(d)


def solo(c: Client, prompt: list[int], n: int, sampling=Sampling.GPU_GREEDY) -> list[int]:
    p = Planner(c, reconnect_timeout=10)
    kw = {}
    if sampling == Sampling.HOST:
        kw["host_sampler"] = lambda row, pos: int(np.argmax(row))
    rid = p.submit(prompt, n, sampling, stop_at_eos=False, **kw)
    return p.run_until_done(10).results[rid].tokens


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def raw_plan_slot(kind: int, record_bytes: int, arena_bytes: int, session: int, body: bytes) -> bytes:
    return struct.pack("<IIQQ", kind & U32, record_bytes & U32, arena_bytes & U64, session & U64) + body


# ------------------------------------------------------------ slot garbage


def test_garbage_in_plan_slots_is_answered_never_run(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    rng = random.Random(11)
    with connect(daemon) as c:
        st0 = state_of(daemon.name)
        mine = stale = 0
        variants = [(k, rb, ab) for k in (0, MsgKind.PLAN, MsgKind.OP, U32) for rb in (0, 8, 16, 104, 105, U32)
                    for ab in (0, 7, 1 << 20, 1 << 63, U64)]
        answers = []
        for i, (kind, rb, ab) in enumerate(variants):
            session = c.session if i % 2 == 0 else rng.getrandbits(64) | 1 << 63
            slot = c.seg.plan_queue.reserve(5)
            msg = raw_plan_slot(kind, rb, ab, session, rng.randbytes(2048))
            slot[:len(msg)] = msg
            c.seg.plan_queue.publish()
            mine, stale = mine + (session == c.session), stale + (session != c.session)
            if i % 4 == 3:  # a valid plan behind them: its answer comes after theirs
                assert c.tick(PlanBuilder(0)).status == Status.OK
                answers += c._ready
                c._ready.clear()
        # Every garbage plan of this session was answered (a reject), none ran; the others stale.
        assert len(answers) == mine and all(e.status not in (Status.OK, Status.StaleSession) for e in answers)
        st = state_of(daemon.name)
        assert st["rejects"] - st0["rejects"] == mine and st["stale_messages"] - st0["stale_messages"] == stale
        assert st["ticks"] - st0["ticks"] == len(variants) // 4
    healthy(daemon, mark, pid)


def test_garbage_in_op_slots_is_answered(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    rng = random.Random(12)
    with connect(daemon) as c:
        for i, (kind, rb, ab) in enumerate((k, rb, ab) for k in (0, MsgKind.OP, MsgKind.PLAN, U32)
                                           for rb in (0, 24, U32) for ab in (0, 3, 5000, 1 << 40, U64)):
            session = c.session if i % 2 == 0 else rng.getrandbits(63) + 1
            body = rng.choice([rng.randbytes(4096), msgpack.packb({"op": rng.randbytes(8), "op_id": -1}),
                               msgpack.packb({"op": "RETIRE_LANES", "all": True, "op_id": U64}),
                               msgpack.packb({"op": "LEASE_SEED", "tokens": [U32] * 50, "ttl_ticks": -5}),
                               msgpack.packb({"op": "REGISTER_LOGIT_BIAS", "bias": {"x": "y"}, "op_id": 3})])
            slot = c.seg.op_queue.reserve(5)
            msg = raw_plan_slot(kind, rb, ab, session, body)
            slot[:len(msg)] = msg
            c.seg.op_queue.publish()
        assert c.op("DESCRIBE").status == OpStatus.OK
        assert c.tick(PlanBuilder(0)).status == Status.OK
    healthy(daemon, mark, pid)


def test_a_session_zero_plan_is_no_reply_to_this_sessions_plan(daemon):
    """A plan stamped session 0 (a planner that never began one, or a hostile
    one) with the connected session's next plan_seq: its StaleSession answer
    must not pass for the answer to that session's own plan."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with connect(daemon) as c, hostile(daemon) as h:
        seq = c.next_plan_seq()
        slot = h.plan_queue.reserve(5)
        codec.encode_into(slot, "TickPlan", PlanBuilder(seq).build(), session=0)
        h.plan_queue.publish()
        time.sleep(0.05)
        ev = c.tick(PlanBuilder(0))
        assert ev.plan_seq == seq and ev.status == Status.OK, ev
    healthy(daemon, mark, pid)


def test_a_session_zero_op_is_no_completion_of_this_sessions_op(daemon):
    """An op stamped session 0 with the connected session's next op_id: its
    completion must not pass for the completion of that session's own op."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with connect(daemon) as c, hostile(daemon) as h:
        h.op_queue.send_bytes(MsgKind.OP, msgpack.packb({"op": "CACHE_CLEAR", "op_id": 1}), timeout=5, session=0)
        time.sleep(0.05)
        done = c.op("DESCRIBE")  # op_id 1 of this session
        assert done.status == OpStatus.OK, done
    healthy(daemon, mark, pid)


def test_a_rewound_session_id_never_hands_a_new_session_old_replies(daemon):
    """A leaves a plan in flight and more queued; someone rewinds the
    header's session_id by one; B connects: B must not be given A's id (A's
    plans would run as B's and their replies come to B)."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    a = connect(daemon)
    tag = a.new_lane_tag()
    a.submit(PlanBuilder(0, prefill_token_budget=64).admit(tag, a.write_prompt([5, 6, 7])).prefill(tag, 0, 3)
             .decode(tag, 150))
    wait_for(lambda: len(a.seg.plan_queue) == 0, "A's first plan in flight")
    for _ in range(3):
        a.submit(PlanBuilder(0).admit(a.new_lane_tag(), a.write_prompt([1, 2])))
    a_session = a.session
    with hostile(daemon) as h:
        lib.sf_store_release_u64(ffi.addressof(h.header, "session_id"), a_session - 1)
    a.close()
    try:
        with connect(daemon) as b:
            ev = b.tick(PlanBuilder(0))
            assert b.session != a_session and not ev.admit_results and not ev.emits, (b.session, a_session, ev)
    finally:
        with connect(daemon, lanes="retire"):
            pass
    healthy(daemon, mark, pid)


# -------------------------------------------------------- queue counters


def test_event_and_stream_heads_moved_by_the_planner_are_reset(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    for q, kind in (("event", QueueKind.EVENT), ("stream", QueueKind.STREAM)):
        for move in (lambda h, t: t - 3, lambda h, t: h + (1 << 40), lambda h, t: U64):
            with connect(daemon) as c, Raw(daemon) as r:
                r.set_head(q, move(r.head(q), r.tail(q)))
                wait_for(lambda: c.seg.queues[q].sane(), f"the worker's reset of the {q} queue", 5)
                ev = c.tick(PlanBuilder(0))
                assert ev.status == Status.OK, ev
                assert int(kind) in [x.queue for x in c.queue_resets], (q, list(c.queue_resets))
    healthy(daemon, mark, pid)


def test_op_queue_counters_and_every_queue_at_once(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with connect(daemon) as c, Raw(daemon) as r:
        assert c.op("REGISTER_LOGIT_BIAS", bias={3: -1.0}).status == OpStatus.OK
        r.set_tail("op", r.tail("op") - 1)  # the worker's counter, moved back: the op runs again
        time.sleep(0.05)
        assert c.op("DESCRIBE").status == OpStatus.OK
        r.set_tail("op", r.head("op") + 5)  # past head
        wait_for(lambda: c.seg.op_queue.sane(), "the op queue reset", 5)
        assert c.op("DESCRIBE").status == OpStatus.OK
        assert int(QueueKind.OP) in [x.queue for x in c.queue_resets]
        c.queue_resets.clear()
        # All four at once, each a different way.
        r.set_head("plan", r.tail("plan") + 10_000)
        r.set_head("event", r.tail("event") - 1)
        r.set_tail("op", r.head("op") + 1)
        r.set_head("stream", U64 // 3)
        wait_for(lambda: all(q.sane() for q in c.seg.queues.values()), "every queue reset", 5)
        assert c.tick(PlanBuilder(0)).status == Status.OK
        assert c.op("DESCRIBE").status == OpStatus.OK
        assert sorted(x.queue for x in c.queue_resets) == sorted(int(k) for k in QueueKind), list(c.queue_resets)
    healthy(daemon, mark, pid)


# ------------------------------------------------------------------ rings


def test_ring_headers_scribbled(daemon):
    """Capacity, ring id, element size, head and reserve of the prompt,
    token and logits rings: the worker keeps the daemon's geometry (and puts
    it back); a planner connected before keeps its own view."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    prompt = [9, 8, 7, 6]
    with connect(daemon) as c:
        want = {m: solo(c, prompt, 4, m) for m in (Sampling.GPU_GREEDY, Sampling.HOST)}
    scribbles = [("capacity", 0), ("capacity", 1 << 62), ("capacity", 3), ("ring_id", 9), ("elem_bytes", 8),
                 ("head", U64), ("reserve", U64), ("head", 1 << 40), ("reserve", 12345)]
    for ring in RINGS:
        with connect(daemon) as c, Raw(daemon) as r:
            for field, value in scribbles:
                setattr(r.ring(ring), field, value)
                for m in want:
                    try:  # this planner's own prompts and reads may fail; the worker must live
                        solo(c, prompt, 4, m)
                    except Exception:  # noqa: BLE001, S110
                        pass
                assert c.seg.header.worker_pid == pid and daemon.proc.poll() is None, mark.text
        wait_for(lambda: _ring_geometry_back(daemon), f"the {ring} ring's geometry put back", 5)
    with connect(daemon) as c:
        assert {m: solo(c, prompt, 4, m) for m in want} == want
    healthy(daemon, mark, pid)


def _ring_geometry_back(d: Serve) -> bool:
    with Raw(d) as r:
        return all(r.ring(x).capacity == d.capacity[x] and r.ring(x).elem_bytes == 4 for x in RINGS)


def test_prompt_ring_data_rewritten_under_a_queued_plan(daemon):
    """The planner rewrites the prompt's tokens (out of the vocabulary)
    after the plan is queued, over and over: the check reads them once."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with connect(daemon) as c, Raw(daemon) as r:
        stop = threading.Event()
        ref = c.write_prompt(list(range(1, 200)))
        at = daemon.layout["prompt_ring"] + ffi.sizeof("DataRing") + ref.offset * 4
        good, bad = np.arange(1, 200, dtype="<u4").tobytes(), np.full(199, U32, dtype="<u4").tobytes()

        def flip():
            while not stop.is_set():
                r.write(at, bad)
                r.write(at, good)

        t = threading.Thread(target=flip)
        t.start()
        try:
            statuses = []
            for _i in range(30):
                tag = c.new_lane_tag()
                ev = c.tick(PlanBuilder(0, prefill_token_budget=512).admit(tag, ref).prefill(tag, 0, 199)
                            .decode(tag, 2))
                statuses.append(ev.status)
                if ev.status == Status.OK:
                    c.tick(PlanBuilder(0).retire(tag))
        finally:
            stop.set()
            t.join()
        assert set(statuses) <= {Status.OK, Status.RejectBounds}, statuses
    healthy(daemon, mark, pid)


# ---------------------------------------------------------- header fields


def test_runtime_description_and_counters_scribbled(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    rng = random.Random(13)
    with connect(daemon) as c, Raw(daemon) as r:
        assert c.describe()  # DESCRIBE answers before the scribble
        r.write(ffi.offsetof("SegmentHeader", "runtime"), rng.randbytes(ffi.sizeof("RuntimeDesc")))
        r.write(ffi.offsetof("SegmentHeader", "counters"), b"\xff" * ffi.sizeof("WorkerCounters"))
        r.h.state_changed_ns = U64
        r.h.restarts, r.h.last_exit_status = U32, -(1 << 31)
        # Make the worker count: a stale plan, a queue reset.
        slot = r.slot("plan", r.head("plan"))
        slot[:len(raw_plan_slot(MsgKind.PLAN, 104, 0, 77, b""))] = raw_plan_slot(MsgKind.PLAN, 104, 0, 77, b"")
        r.set_head("plan", r.head("plan") + 1)
        time.sleep(0.05)
        r.set_tail("op", r.head("op") + 2)
        wait_for(lambda: c.seg.op_queue.sane(), "the op queue reset", 5)
        assert c.tick(PlanBuilder(0)).status == Status.OK
        format_status(read_status(daemon.name))  # status reads whatever is there
        assert cli_main(["status", daemon.name]) == 0 and cli_main(["status", daemon.name, "--json"]) == 0
    healthy(daemon, mark, pid)


def test_session_id_zeroed_or_random_mid_session(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with Raw(daemon) as r:
        before = int(r.h.session_id)
        try:
            # Below 2**32: the worker never lets the header's session_id fall below one it has
            # served, and a later test writes 2**40.
            for value in (0, 1 << 31, random.Random(14).getrandbits(31)):
                with connect(daemon) as c:
                    assert c.tick(PlanBuilder(0)).status == Status.OK
                    lib.sf_store_release_u64(ffi.addressof(r.h, "session_id"), value)
                    ev = c.tick(PlanBuilder(0))  # this session may have lost the worker: then StaleSession
                    assert ev.status in (Status.OK, Status.StaleSession), ev
                time.sleep(0.05)
                assert fresh_tick(daemon) == pid
        finally:
            r.sessions_after(before)
    healthy(daemon, mark, pid)


def test_a_wrapped_session_id_gives_the_next_planner_a_working_session(daemon):
    """session_id at 2**64 - 1: sf_session_begin wraps past 0 to 1, an id
    below the worker's current session; the next planner's plans must still
    be served (not StaleSession)."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with Raw(daemon) as r:
        before = int(r.h.session_id)
        try:
            lib.sf_store_release_u64(ffi.addressof(r.h, "session_id"), U64)
            time.sleep(0.05)
            with connect(daemon, timeout=5) as c:
                ev = c.tick(PlanBuilder(0), timeout=5)
                assert ev.status == Status.OK, (c.session, ev)
        finally:
            r.sessions_after(before)
    healthy(daemon, mark, pid)


def test_worker_pid_scribbled_is_put_back(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    for value in (0, 1, dead_pid(), U32, os.getpid()):
        with hostile(daemon) as h:
            h.header.worker_pid = value
            wait_for(lambda: h.header.worker_pid == pid, "the worker's pid back", 5)
        assert fresh_tick(daemon) == pid
    healthy(daemon, mark, pid)


IDENTITY = {  # field: a value no daemon wrote (daemon_pid: a dead process)
    "magic": 0x4141414141414141, "abi_version": 1, "header_bytes": 64, "segment_bytes": 4096,
    "owner_uid": 4242, "worker_index": 3, "daemon_pid": None,
}


def test_identity_and_daemon_pid_scribbled_while_running_are_put_back(daemon):
    """Line 0 (magic, ABI version, sizes, owner, name, index) and daemon_pid
    scribbled while the worker runs: put back within two seconds, and a new
    planner connects (else SegmentError, or DaemonGone for daemon_pid, until
    the next restart)."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with Raw(daemon) as r:
        want = {f: getattr(r.h, f) for f in IDENTITY}
        try:
            for field, value in IDENTITY.items():
                setattr(r.h, field, dead_pid() if value is None else value)
            ffi.memmove(r.h.name, b"someone-else".ljust(len(r.h.name), b"\0"), len(r.h.name))
            time.sleep(2.0)  # twice the worker's geometry check
            left = {f: getattr(r.h, f) for f in IDENTITY if getattr(r.h, f) != want[f]}
            if ffi.string(r.h.name) != daemon.name.encode():
                left["name"] = ffi.string(r.h.name)
            try:
                fresh_tick(daemon, timeout=1.0)
                refused = None
            except Exception as e:  # noqa: BLE001
                refused = f"{type(e).__name__}: {e}"
            assert not left and refused is None, (left, refused)
        finally:
            r.restore_identity()
    healthy(daemon, mark, pid)


def test_yield_and_latency_flags_stuck(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    prompt = list(range(1, 300))
    with connect(daemon) as c:
        want = solo(c, prompt, 8)
    with hostile(daemon) as h:
        try:
            for y, lat in ((1, 0), (0, U32), (U32, 1)):
                lib.sf_store_release_u32(ffi.addressof(h.header, "yield_requested"), y)
                lib.sf_store_release_u32(ffi.addressof(h.header, "latency_wanted"), lat)
                with connect(daemon) as c:
                    assert solo(c, prompt, 8) == want, (y, lat)
        finally:
            h.yield_requested = h.latency_wanted = False
    healthy(daemon, mark, pid)


# --------------------------------------------------------------- sessions


def test_quick_connect_close_cycles(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    for i in range(40):  # submit and leave: the replies are the next session's to drop
        c = connect(daemon)
        c.submit(PlanBuilder(0))
        if i % 3 == 0:
            c.seg.op_queue.send_bytes(MsgKind.OP, msgpack.packb({"op": "DESCRIBE", "op_id": 1}), timeout=5,
                                      session=c.session)
        c.close()
    for _ in range(10):
        with connect(daemon) as c:
            ev = c.tick(PlanBuilder(0))
            assert ev.status == Status.OK and ev.plan_seq == 1, ev
            assert c.op("DESCRIBE").status == OpStatus.OK
    healthy(daemon, mark, pid)


PLANNER = r"""
import sys, time
from superfluid.abi import codec
from superfluid.cli import main as cli_main
from superfluid.client import Client, PlanBuilder
c = Client.connect(sys.argv[1], 0, timeout=30)
print("connected", flush=True)
if sys.argv[2] == "hold":
    time.sleep(60)
q = c.seg.plan_queue
n = 0
while True:  # plans, each published half-written, and never a read of the events
    slot = q.try_reserve()
    if slot is None:
        continue
    plan = PlanBuilder(c.next_plan_seq() + n).admit(n + 1, c.write_prompt([1, 2, 3])).build()
    codec.encode_into(slot, "TickPlan", plan,
                      session=c.session)
    slot[40:200] = bytes(160)
    q.publish()
    n += 1
"""


def test_a_planner_sigkilled_with_the_lock_or_mid_write(daemon):
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    for mode in ("hold", "write"):
        p = subprocess.Popen([*python(), "-c", PLANNER, daemon.name, mode], stdout=subprocess.PIPE)
        try:
            assert p.stdout.readline().strip() == b"connected"
            time.sleep(0.3)
            with pytest.raises(ClientError, match="already has a planner"):
                connect(daemon, timeout=1)
        finally:
            p.kill()
            p.wait()
        assert fresh_tick(daemon, timeout=10) == pid
    healthy(daemon, mark, pid)


def test_a_planner_that_never_reads_loses_nothing(daemon):
    """Plans and ops for two seconds without reading an event; then every
    plan's events, in order, and every op's completion, once."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with connect(daemon) as c:
        sent, op_ids = [], []
        end = time.monotonic() + 2.0
        op_id = 1000
        while time.monotonic() < end:
            try:
                sent.append(c.submit(PlanBuilder(0), timeout=0.01))
            except ClientTimeout:
                pass
            try:
                c.seg.op_queue.send_bytes(MsgKind.OP, msgpack.packb({"op": "DESCRIBE", "op_id": op_id}),
                                          timeout=0.01, session=c.session)
                op_ids.append(op_id)
                op_id += 1
            except Exception:  # noqa: BLE001 — the op queue full
                pass
        assert len(sent) >= 16 and len(op_ids) >= 64, (len(sent), len(op_ids))
        got = [c.wait_events(10) for _ in sent]
        assert [e.plan_seq for e in got] == sent and all(e.status == Status.OK for e in got)
        deadline = time.monotonic() + 10
        while not all(i in c._completions for i in op_ids) and time.monotonic() < deadline:
            c._pump(0.5)
        missing = [i for i in op_ids if i not in c._completions]
        assert not missing, (len(missing), len(op_ids))
        assert all(c._completions[i].status == OpStatus.OK for i in op_ids)
        assert c.tick(PlanBuilder(0)).status == Status.OK
    healthy(daemon, mark, pid)


def test_two_planners_at_once_out_of_contract(daemon):
    """A drops its lock but keeps writing plans (and reading nothing) while
    B connects and ticks: the queues have two producers. Out of contract:
    B may lose plans (timeouts) or see A's replies; the worker must live."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    a = connect(daemon)
    os.close(a._lock)
    a._lock = None
    stop = threading.Event()
    a_sent = [0]

    def a_writes():
        tag = 1 << 40
        while not stop.is_set():
            try:
                a.submit(PlanBuilder(0).admit(tag, a.write_prompt([1, 2, 3])), timeout=0.01)
                a_sent[0] += 1
                tag += 1
            except Exception:  # noqa: BLE001
                time.sleep(0.0005)

    t = threading.Thread(target=a_writes)
    t.start()
    seen: dict[str, int] = {}
    try:
        with connect(daemon) as b:
            for _ in range(20):
                try:
                    ev = b.tick(PlanBuilder(0), timeout=1.0)
                    own = ev.status == Status.OK and not ev.admit_results
                    key = "own" if own else f"other:{Status(ev.status).name}"
                except Exception as e:  # noqa: BLE001
                    key = type(e).__name__
                seen[key] = seen.get(key, 0) + 1
    finally:
        stop.set()
        t.join()
        a.close()
    assert sum(seen.values()) == 20 and a_sent[0] > 0, (seen, a_sent)  # both wrote: two producers
    with connect(daemon, lanes="retire"):
        pass
    healthy(daemon, mark, pid)


def test_plan_queue_geometry_scribbled_while_a_planner_connects(daemon):
    """A power-of-two n_slots smaller than the daemon's fits the mapping: a
    planner connecting while it is there must refuse it (or its plans would
    go to slots the worker never reads)."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    n, _ = daemon.geometry["plan"]
    with Raw(daemon) as r:
        c = _connect_while(daemon, lambda: setattr(r.queue("plan"), "n_slots", n // 2))
        r.queue("plan").n_slots = n
    try:
        for _ in range(n):
            ev = c.tick(PlanBuilder(0), timeout=1)
            assert ev.status == Status.OK, ev
    finally:
        c.close()
    healthy(daemon, mark, pid)


def _connect_while(d: Serve, scribble) -> Client:
    """Connect while a planner keeps writing `scribble` (so that the worker's
    once-a-second repair cannot come between it and the attach); if the
    connect refuses the scribbled header, stop and connect once the worker
    has put it back. Either way the planner gets a Client that must work."""
    stop = threading.Event()

    def again():
        while not stop.is_set():
            scribble()
            time.sleep(0.0001)

    t = threading.Thread(target=again)
    t.start()
    try:
        return connect(d, timeout=0.3)
    except (ClientError, SegmentError):
        pass  # refused while wrong: good
    finally:
        stop.set()
        t.join()
    return connect(d, timeout=5)


@pytest.mark.parametrize("queue,kind", [("event", MsgKind.EVENTS), ("stream", MsgKind.PARTIAL)])
def test_garbage_in_event_and_stream_slots_does_not_break_a_fresh_client(daemon, queue, kind):
    """The planner's own queues to read, but a fresh planner drains what is
    there at connect: one slot of session 0 that does not decode."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with Raw(daemon) as r:
        head = r.head(queue)
        slot = r.slot(queue, head)
        msg = raw_plan_slot(kind, 7, 1 << 40, 0, b"\x00" * 32)
        slot[:len(msg)] = msg
        r.set_head(queue, head + 1)
    fresh_tick(daemon, timeout=5)
    healthy(daemon, mark, pid)


def test_a_huge_session_id_leaves_new_planners_lane_tags_in_range(daemon):
    """One write of session_id past 2**32: a new planner's lane tags
    (from its session) must stay in u64, its admits encodable."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with Raw(daemon) as r:
        before = int(r.h.session_id)
        lib.sf_store_release_u64(ffi.addressof(r.h, "session_id"), 1 << 40)
        try:
            with connect(daemon) as c:
                assert solo(c, [1, 2, 3], 2)
        finally:
            r.sessions_after(before)
    healthy(daemon, mark, pid)


def test_prompt_ring_capacity_scribbled_while_a_planner_connects(daemon):
    """As the plan queue's n_slots: a capacity smaller than the daemon's fits
    the mapping; a planner connecting meanwhile must not keep it (every
    prompt over 3 tokens would be refused for that planner's life)."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with Raw(daemon) as r:
        c = _connect_while(daemon, lambda: setattr(r.ring("prompt"), "capacity", 3))
        r.ring("prompt").capacity = daemon.capacity["prompt"]
    try:
        assert solo(c, [1, 2, 3, 4, 5], 2)
    finally:
        c.close()
    healthy(daemon, mark, pid)


# ----------------------------------------------- counters moved mid-message


def _until_exit(d: Serve, mark: Mark, go, seconds: float) -> None:
    """Run `go(stop)` in a thread until the worker exits (or the daemon does)
    or `seconds` pass."""
    stop = threading.Event()
    t = threading.Thread(target=go, args=(stop,))
    t.start()
    try:
        wait_for(lambda: mark.exits() or d.proc.poll() is not None or stop.is_set(), "an exit", seconds)
    except AssertionError:
        pass  # none: the worker held
    finally:
        stop.set()
        t.join()


@pytest.mark.parametrize("queue", ["plan", "op"])
def test_a_message_unpublished_while_the_worker_holds_it(daemon, queue):
    """The planner moves its head back over a message the worker has peeked:
    the worker's release finds the queue empty."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    msg = codec.encode("TickPlan", PlanBuilder(1).build(), session=12345) if queue == "plan" else \
        raw_plan_slot(MsgKind.OP, 0, 4, 12345, msgpack.packb({"a": 1}))

    def go(stop):
        with Raw(daemon) as r:
            while not stop.is_set():
                h = t = r.tail(queue)
                r.slot(queue, h)[:len(msg)] = msg
                for _ in range(500):  # published, unpublished, ... until the worker takes it
                    r.set_head(queue, h + 1)
                    r.set_head(queue, h)
                    if r.tail(queue) != t:
                        break
                r.set_head(queue, r.tail(queue))

    _until_exit(daemon, mark, go, 2.0)
    healthy(daemon, mark, pid)


def _own_daemon(tmp_path, tag: str) -> Serve:
    s = Serve(tmp_path, f"{tag}{os.getpid()}", *FAKE)
    s.wait_log("worker 0 ready (epoch 1")
    with Segment.open(s.name, 0) as seg:
        s.layout = {f"{q}_queue": int(getattr(seg.header.layout, f"{q}_queue")) for q in QUEUES}
        s.geometry = {q: (seg.queues[q].n_slots, seg.queues[q].slot_bytes) for q in QUEUES}
    return s


def _toggle_event_tail(d: Serve):
    n, _ = d.geometry["event"]

    def go(stop):
        with Raw(d) as r:
            while not stop.is_set():  # the planner's counter: the queue full, then not
                t = r.tail("event")
                r.set_tail("event", t - n)
                r.set_tail("event", t)

    return go


def test_the_event_queue_filled_while_the_worker_publishes(tmp_path):
    """The planner moves its event tail back (the queue full) between the
    worker's reserve and publish. Own daemon: the daemon's notice about the
    exit races the same writes (next test)."""
    d = _own_daemon(tmp_path, "hte")
    try:
        mark = Mark(d)
        pid = worker_pid(d)
        toggle = _toggle_event_tail(d)

        def go(stop):
            t = threading.Thread(target=toggle, args=(stop,))
            t.start()
            try:
                with connect(d, timeout=5) as c:
                    while not stop.is_set():
                        try:
                            c.tick(PlanBuilder(0), timeout=0.5)
                        except ClientError:
                            pass
            finally:
                t.join()

        _until_exit(d, mark, go, 2.0)
        healthy(d, mark, pid)
    finally:
        d.close()


def test_the_event_queue_filled_while_the_daemon_posts_a_notice(tmp_path):
    """The same writes while the daemon puts its WorkerNotice on the event
    queue (a worker killed, then restarted): the daemon must not exit."""
    d = _own_daemon(tmp_path, "htd")
    try:
        mark = Mark(d)
        stop = threading.Event()
        t = threading.Thread(target=_toggle_event_tail(d), args=(stop,))
        t.start()
        try:
            end = time.monotonic() + 3.0
            while time.monotonic() < end and d.proc.poll() is None:
                st = state_of(d.name) or {}
                if st.get("state") == "READY" and st.get("pid"):
                    try:
                        os.kill(st["pid"], 9)
                    except ProcessLookupError:
                        pass
                time.sleep(0.05)
        finally:
            stop.set()
            t.join()
        assert d.proc.poll() is None, mark.brief()
    finally:
        d.close()


# ------------------------------------------------------------------ fuzz


def _fuzz(d: Serve, regions: list[tuple[int, int]], seconds: float, seed: int) -> dict[str, int]:
    """Random bytes at random places of `regions` while a well-behaved
    planner drives requests in another thread; what the planner saw."""
    stop = threading.Event()
    seen: dict[str, int] = {}

    def drive():
        while not stop.is_set():
            try:
                with connect(d, timeout=2) as c:
                    p = Planner(c, reconnect_timeout=2)
                    while not stop.is_set():
                        p.submit([3, 4, 5, 6], 4, stop_at_eos=False)
                        p.run_until_done(2)
                        seen["ok"] = seen.get("ok", 0) + 1
            except Exception as e:  # noqa: BLE001 — the driver may be misled; the worker must live
                seen[type(e).__name__] = seen.get(type(e).__name__, 0) + 1
                time.sleep(0.01)

    t = threading.Thread(target=drive)
    t.start()
    rng = random.Random(seed)
    with Raw(d) as r:
        before = int(r.h.session_id)
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                at, n = rng.choice(regions)
                off = at + rng.randrange(n)
                r.write(off, rng.randbytes(min(rng.choice((1, 2, 4, 8, 8, 16)), at + n - off)))
                time.sleep(0.0005)
        finally:
            stop.set()
            t.join()
            r.sessions_after(before)  # the lane-tag test's finding: not what this one looks at
    return seen


def _queue_regions(d: Serve, counters: bool = True) -> list[tuple[int, int]]:
    """The four Queue headers; without their head and tail words when not
    `counters` (racing those is the publish/release tests' business)."""
    if counters:
        return [(d.layout[f"{q}_queue"], ffi.sizeof("Queue")) for q in QUEUES]
    tail = ffi.offsetof("Queue", "tail")
    return [r for q in QUEUES for r in ((d.layout[f"{q}_queue"] + 8, tail - 8),
                                        (d.layout[f"{q}_queue"] + tail + 8, ffi.sizeof("Queue") - tail - 8))]


def test_random_bytes_over_the_header_but_its_identity_and_the_queues(daemon):
    """Everything a planner can reach in the header but line 0 and
    daemon_pid (the identity test: nothing running puts those back), and the
    queue headers but their counters (the publish/release race tests)."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    line1 = ffi.offsetof("SegmentHeader", "worker_epoch")
    dpid = ffi.offsetof("SegmentHeader", "daemon_pid")
    regions = [(line1, dpid - line1), (dpid + 4, ffi.sizeof("SegmentHeader") - dpid - 4)] + \
        _queue_regions(daemon, counters=False)
    seen = _fuzz(daemon, regions, 2.0, 16)
    assert seen, "the driver never ran while the bytes were written"
    healthy(daemon, mark, pid)


def test_random_bytes_over_the_whole_header_and_the_queues(daemon):
    """Line 0 and daemon_pid too: the worker survives (its queues reset and
    reported), and once the identity is put back a fresh planner ticks."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    try:
        seen = _fuzz(daemon, [(0, ffi.sizeof("SegmentHeader"))] + _queue_regions(daemon), 2.0, 17)
        assert seen, "the driver never ran while the bytes were written"
        time.sleep(1.1)  # a geometry check
        fresh_tick(daemon, timeout=2)
    finally:
        with Raw(daemon) as r:
            r.restore_identity()
    healthy(daemon, mark, pid, restarts=1)


def test_identity_and_counters_scribbled_then_a_restart_is_clean(daemon):
    """Line 0, daemon_pid, restarts (at its maximum), last_exit_status and
    the worker state scribbled once, then kill -9: the daemon repairs all of
    it and restarts the worker once, cleanly."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    with Raw(daemon) as r:
        for field, value in IDENTITY.items():
            setattr(r.h, field, dead_pid() if value is None else value)
        ffi.memmove(r.h.name, b"someone-else".ljust(len(r.h.name), b"\0"), len(r.h.name))
        r.h.restarts, r.h.last_exit_status, r.h.worker_state, r.h.fault_injection = U32, 1 << 30, 99, 7
        os.kill(pid, 9)
    wait_for(lambda: (state_of(daemon.name) or {}).get("state") == "READY" and state_of(daemon.name)["pid"] != pid,
             "the restarted worker", 20)
    assert [e for e in mark.exits() if "signal 9" not in e] == [] and "magic was wrong" in mark.text, mark.text
    healthy(daemon, mark, None, restarts=1)


def test_a_restart_under_a_scribbling_planner_is_clean(daemon):
    """kill -9 the worker while a planner keeps scribbling identity, state,
    epoch, layout and geometry: the daemon restarts it once, cleanly."""
    mark = Mark(daemon)
    pid = worker_pid(daemon)
    stop = threading.Event()
    with Raw(daemon) as r:
        r.h.restarts = U32
        r.h.last_exit_status = 1 << 30

        def scribble():
            rng = random.Random(15)
            mm, lay = r.mm, ffi.offsetof("SegmentHeader", "layout")
            junk = [rng.randbytes(64) for _ in range(64)]
            i = 0
            while not stop.is_set():  # as fast as it goes: what the worker writes is gone at once
                mm[0:8] = bytes(8)  # magic
                mm[lay:lay + 64] = junk[i % 64]  # the layout
                i += 1
                if i % 64 == 0:
                    r.h.abi_version = 1
                    r.h.worker_state = 99
                    r.h.worker_epoch = rng.getrandbits(64)
                    r.queue("plan").n_slots = 3
                    r.ring("logits").capacity = 0
                    r.h.worker_pid = 0

        t = threading.Thread(target=scribble)
        t.start()
        try:
            os.kill(pid, 9)
            time.sleep(2.5)  # longer than a worker start
        finally:
            stop.set()
            t.join()
            # What it left in the identity line stays until the next restart (the test above):
            # put that back by hand here, so that this test looks at the restart alone.
            r.h.abi_version = 2
            lib.sf_store_release_u64(ffi.addressof(r.h, "magic"), 0x31564449554c4653)
    wait_for(lambda: (state_of(daemon.name) or {}).get("state") == "READY" and state_of(daemon.name)["pid"] != pid,
             "the restarted worker", 20)
    assert [e for e in mark.exits() if "signal 9" not in e] == [], mark.text
    healthy(daemon, mark, None, restarts=1)
