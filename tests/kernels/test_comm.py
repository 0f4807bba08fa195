"""kernels/comm.py, the shared-memory collective of one TP group, across real
processes: what every rank gets is bitwise what each rank sent, and the same
as torch.distributed's gloo on the same inputs; a lying rank is seen; a peer
that never comes, is stopped or is killed makes the others raise CommTimeout
naming it; bad arguments are refused by name.

The ranks are this file run as a script (`python -P test_comm.py worker ...`:
pytest's importlib mode leaves no module name a spawned child could import),
driven over stdin/stdout with pickled commands."""

from __future__ import annotations

import mmap
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from superfluid.kernels.comm import CommMismatch, CommTimeout, ShmComm

DTYPES = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float32": torch.float32, "int64": torch.int64}
SLOT = 4096
LONG = 60.0  # seconds: the bound of waits that should succeed (a slow, shared machine)
REPLY_S = 120.0  # a worker's answer to one command


def _shm_path() -> str:
    return f"/dev/shm/sf-comm-test-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _tensor(payload: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    t = torch.empty(shape, dtype=DTYPES[dtype])
    t.view(torch.uint8).view(-1)[:] = torch.tensor(list(payload), dtype=torch.uint8)
    return t


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).view(-1).tolist())


# ----------------------------------------------------------------- worker side


def _run_ops(comm: ShmComm, ops: list[Any], use_gloo: bool, lie: tuple[int, int] | None) -> list[Any]:
    """Each op through the comm (and gloo): per op (shm result, gloo result or None).
    lie=(op, rank): that rank flips one bit of what it sends at that op."""
    import torch.distributed as dist

    out = []
    for i, (kind, dtype, shape, payloads) in enumerate(ops):
        mine = payloads[comm.rank] if kind == "gather" else payloads[0]
        if lie == (i, comm.rank) and mine:
            mine = bytes([mine[0] ^ 1]) + mine[1:]
        if kind == "gather":
            src = _tensor(mine, dtype, shape)
            got = torch.empty((comm.world, *shape), dtype=src.dtype)
            comm.all_gather(src, got, LONG)
            shm = _bytes(got)
            if use_gloo:
                parts = [torch.empty_like(src) for _ in range(comm.world)]
                dist.all_gather(parts, src)
                ref: bytes | None = b"".join(_bytes(p) for p in parts)
            else:
                ref = None
        else:
            shm = comm.broadcast(mine if comm.rank == 0 else None, LONG)
            if use_gloo:
                box: list[Any] = [mine if comm.rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
                ref = box[0]
            else:
                ref = None
        out.append((shm, ref))
    return out


def _stress(comm: ShmComm, calls: int, corrupt_at: int) -> list[str]:
    """calls back-to-back collectives of varying kinds and sizes, each rank's
    data a function of (rank, call): returns what differed (rank 1 sends
    wrong data at call corrupt_at, if >= 0)."""
    bad = []
    for i in range(calls):
        if i % 3 == 2:
            n = (i * 7919) % SLOT
            want = bytes((i + j) % 251 for j in range(n))
            got = comm.broadcast(want if comm.rank == 0 else None, LONG)
            if got != want:
                bad.append(f"call {i}: broadcast")
        else:
            n = (i * 131) % (SLOT // 4 + 1)
            src = torch.arange(n, dtype=torch.int32) + 100000 * comm.rank + i
            if i == corrupt_at and comm.rank == 1 and n:
                src[n // 2] += 1
            out = torch.empty((comm.world, n), dtype=torch.int32)
            comm.all_gather(src, out, LONG)
            for r in range(comm.world):
                if not torch.equal(out[r], torch.arange(n, dtype=torch.int32) + 100000 * r + i):
                    bad.append(f"call {i}: rank {r}'s data")
    return bad


def _worker(path: str, world: int, rank: int, slot_bytes: int, gloo_dir: str) -> None:
    reply = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints (gloo, torch) go to stderr, not into the replies
    if gloo_dir:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{gloo_dir}/rdzv", rank=rank, world_size=world)
    comm = ShmComm.create(path, world, slot_bytes) if rank == 0 else ShmComm.attach(path, world, rank, slot_bytes,
                                                                                   LONG)

    def send(obj: Any) -> None:
        pickle.dump(obj, reply)
        reply.flush()

    send(("ready", os.getpid()))
    while True:
        cmd = pickle.load(sys.stdin.buffer)
        try:
            if cmd[0] == "ops":
                send(("ok", _run_ops(comm, cmd[1], bool(gloo_dir), cmd[2])))
            elif cmd[0] == "stress":
                send(("ok", _stress(comm, cmd[1], cmd[2])))
            elif cmd[0] == "gather_once":  # one all_gather with a given timeout
                comm.all_gather(torch.zeros(3), torch.zeros(world, 3), cmd[1])
                send(("ok", None))
            elif cmd[0] == "bcast_once":
                send(("ok", comm.broadcast(b"x" if rank == 0 else None, cmd[1])))
            elif cmd[0] == "stop":
                comm.close()
                send(("ok", None))
                return
        except Exception as e:  # reported, not fatal: the test reads it
            send(("error", type(e).__name__, str(e)))


# ----------------------------------------------------------------- test side


class Group:
    """Worker processes for `ranks` of a group; the test process may be rank 0
    itself (ranks without 0: it creates the segment)."""

    def __init__(self, tmp: Path, world: int, ranks: list[int], slot_bytes: int = SLOT, gloo: bool = False) -> None:
        self.path, self.world, self.slot_bytes = _shm_path(), world, slot_bytes
        self.comm = ShmComm.create(self.path, world, slot_bytes) if 0 not in ranks else None
        gloo_dir = ""
        if gloo:
            (tmp / "gloo").mkdir()
            gloo_dir = str(tmp / "gloo")
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.logs: dict[int, Path] = {}
        for r in ranks:
            self.logs[r] = tmp / f"rank{r}.log"
            with open(self.logs[r], "wb") as log:
                self.procs[r] = subprocess.Popen(
                    [sys.executable, "-P", __file__, "worker", self.path, str(world), str(r), str(slot_bytes),
                     gloo_dir], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        for r in ranks:
            assert self.recv(r)[0] == "ready"

    def send(self, r: int, *cmd: Any) -> None:
        stdin = self.procs[r].stdin
        assert stdin is not None
        pickle.dump(cmd, stdin)
        stdin.flush()

    def recv(self, r: int, timeout: float = REPLY_S) -> Any:
        stdout = self.procs[r].stdout
        assert stdout is not None
        if not select.select([stdout], [], [], timeout)[0]:
            raise AssertionError(f"rank {r} did not answer in {timeout} s: {self.logs[r].read_text()[-2000:]}")
        try:
            return pickle.load(stdout)
        except EOFError:
            raise AssertionError(f"rank {r} died: {self.logs[r].read_text()[-2000:]}") from None

    def all(self, *cmd: Any) -> dict[int, Any]:
        for r in self.procs:
            self.send(r, *cmd)
        replies = {r: self.recv(r) for r in self.procs}
        for r, rep in replies.items():
            assert rep[0] == "ok", (r, rep)
        return {r: rep[1] for r, rep in replies.items()}

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout):
                if f:
                    f.close()
        if self.comm is not None:
            self.comm.close()
        if os.path.exists(self.path):  # rank 0 was a killed worker
            os.unlink(self.path)

    def __enter__(self) -> Group:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@st.composite
def schedules(draw: Any, world: int) -> list[Any]:
    """A few calls: (kind, dtype, shape, each rank's payload bytes)."""
    ops = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            dtype = draw(st.sampled_from(sorted(DTYPES)))
            item = DTYPES[dtype].itemsize
            n = draw(st.integers(0, SLOT // (2 * item)))
            shape = (2, n)  # [2, n_tokens]-like partial sums
            payloads = [draw(st.binary(min_size=2 * n * item, max_size=2 * n * item)) for _ in range(world)]
            ops.append(("gather", dtype, shape, payloads))
        else:
            ops.append(("bcast", "uint8", (), [draw(st.binary(max_size=SLOT))]))
    return ops


def differences(ops: list[Any], results: dict[int, list[Any]]) -> list[str]:
    """Where a rank's result is not what the ranks sent, or not gloo's."""
    bad = []
    for rank, per_op in results.items():
        for i, ((kind, _, _, payloads), (shm, ref)) in enumerate(zip(ops, per_op, strict=True)):
            want = b"".join(payloads) if kind == "gather" else payloads[0]
            if shm != want:
                bad.append(f"op {i} ({kind}) on rank {rank}: not what was sent")
            if ref is not None and ref != want:
                bad.append(f"op {i} ({kind}) on rank {rank}: gloo got another result")
    return bad


@pytest.mark.parametrize("world", [2, 4])
def test_all_gather_and_broadcast_match_what_was_sent_and_gloo(tmp_path: Path, world: int) -> None:
    with Group(tmp_path, world, list(range(world)), gloo=True) as g:

        @settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.data_too_large])
        @given(schedules(world))
        def check(ops: list[Any]) -> None:
            assert differences(ops, g.all("ops", ops, None)) == []

        check()
        # a full slot and an empty call, then a lying rank: the same check sees it (negative control)
        full = [("gather", "float32", (SLOT // 4,), [bytes([r + 1]) * SLOT for r in range(world)]),
                ("bcast", "uint8", (), [bytes(range(256)) * (SLOT // 256)]),
                ("gather", "int64", (0,), [b""] * world)]
        assert differences(full, g.all("ops", full, None)) == []
        seen = differences(full, g.all("ops", full, (0, 1)))
        assert seen and all(s.startswith("op 0 (gather)") for s in seen), seen
        assert len([s for s in seen if "not what was sent" in s]) == world  # every rank got the lie


def test_many_consecutive_calls_and_a_corrupted_one(tmp_path: Path) -> None:
    with Group(tmp_path, 4, [0, 1, 2, 3]) as g:
        assert g.all("stress", 600, -1) == {r: [] for r in range(4)}
        # negative control: rank 1 sends a wrong element at call 301; every rank sees it there only
        assert g.all("stress", 600, 301) == {r: ["call 301: rank 1's data"] for r in range(4)}


def test_a_peer_that_never_calls_or_is_stopped(tmp_path: Path) -> None:
    with Group(tmp_path, 3, [1, 2]) as g:
        assert g.comm is not None
        os.kill(g.procs[2].pid, signal.SIGSTOP)
        g.send(1, "gather_once", 3.0)
        with pytest.raises(CommTimeout, match=r"rank 0: rank\(s\) \[2\] did not arrive within 1.0 s") as e:
            g.comm.all_gather(torch.zeros(3), torch.zeros(3, 3), 1.0)
        assert e.value.ranks == [2] and not e.value.retryable  # its part was out
        rep = g.recv(1)
        assert rep[:2] == ("error", "CommTimeout") and "rank 1: rank(s) [2] did not arrive" in rep[2], rep
        os.kill(g.procs[2].pid, signal.SIGCONT)
        with pytest.raises(RuntimeError, match="unusable"):  # a timed-out comm stays failed
            g.comm.broadcast(b"", 1.0)


def test_followers_see_a_silent_root_and_the_root_a_killed_peer(tmp_path: Path) -> None:
    with Group(tmp_path, 2, [1]) as g:
        assert g.comm is not None
        g.send(1, "bcast_once", 0.5)
        rep = g.recv(1)
        assert rep[:2] == ("error", "CommTimeout") and "rank(s) [0]" in rep[2] and "nothing sent" in rep[2], rep
        g.procs[1].kill()
        g.procs[1].wait()
        assert g.comm.broadcast(b"step", 1.0) == b"step"  # call 1: rank 0 waits for no one yet
        for _ in range(2):  # still waiting for rank 1 to read call 1: nothing sent, so again
            with pytest.raises(CommTimeout, match=r"rank\(s\) \[1\]") as e:
                g.comm.all_gather(torch.zeros(2), torch.zeros(2, 2), 0.3)
            assert e.value.ranks == [1] and e.value.retryable


# ------------------------------------------------- in one process, ranks on threads


def _pair(world: int = 2, slot_bytes: int = 64) -> list[ShmComm]:
    path = _shm_path()
    comms = [ShmComm.create(path, world, slot_bytes)]
    return comms + [ShmComm.attach(path, world, r, slot_bytes, 5.0) for r in range(1, world)]


def _on_threads(*calls: Any) -> list[Any]:
    """Run each call on its own thread; what each returned or raised."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_waits_without_the_gil() -> None:
    """Rank 1, on a thread, publishes its part and waits in C for rank 0;
    this thread sees that in the segment (rank 1's sequence word, sf_comm.c's
    layout: 128-byte header, a 64-byte line per rank) and only then calls as
    rank 0. Held during the wait, the GIL would stop this thread until rank
    1 timed out."""
    c0, c1 = _pair()
    try:
        got: list[Any] = []
        out1 = torch.zeros(2, 2)
        t = threading.Thread(target=lambda: got.append(_on_threads(
            lambda: c1.all_gather(torch.tensor([3.0, 4.0]), out1, 30.0))[0]))
        with open(c0.path, "rb") as f, mmap.mmap(f.fileno(), 256, prot=mmap.PROT_READ) as m:
            t.start()
            while struct.unpack_from("<Q", m, 128 + 64)[0] != 1:
                assert t.is_alive(), got  # rank 1 cannot be done before rank 0 calls but by timing out
        out0 = torch.zeros(2, 2)
        c0.all_gather(torch.tensor([1.0, 2.0]), out0, 30.0)
        t.join()
        assert got == [None] and out0.tolist() == out1.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    finally:
        c1.close()
        c0.close()


def test_an_idle_follower_waits_again_after_a_timeout() -> None:
    """A broadcast that timed out sent nothing: the follower (and rank 0)
    may call again, and the group stays in step."""
    c0, c1 = _pair()
    try:
        for _ in range(2):
            with pytest.raises(CommTimeout, match="nothing sent") as e:
                c1.broadcast(None, 0.05)
            assert e.value.ranks == [0] and e.value.retryable
        assert _on_threads(lambda: c0.broadcast(b"step", 5.0), lambda: c1.broadcast(None, 5.0)) == [b"step"] * 2
        outs = [torch.zeros(2, 1), torch.zeros(2, 1)]
        _on_threads(lambda: c0.all_gather(torch.ones(1), outs[0], 5.0),
                    lambda: c1.all_gather(torch.ones(1) * 2, outs[1], 5.0))
        assert outs[0].tolist() == outs[1].tolist() == [[1.0], [2.0]]
    finally:
        c1.close()
        c0.close()


def test_in_place_gather_and_world_one() -> None:
    c0, c1 = _pair(slot_bytes=16)
    try:
        outs = [torch.arange(8, dtype=torch.int16).view(2, 4) * 0 for _ in range(2)]
        for r, out in enumerate(outs):
            out[r] = torch.arange(4, dtype=torch.int16) + 10 * r
        res = _on_threads(*[lambda c=c, o=o: c.all_gather(o[c.rank], o, 5.0) for c, o in zip((c0, c1), outs)])
        assert res == [None, None]
        want = torch.stack([torch.arange(4, dtype=torch.int16), torch.arange(4, dtype=torch.int16) + 10])
        assert torch.equal(outs[0], want) and torch.equal(outs[1], want)
    finally:
        c1.close()
        c0.close()
    with ShmComm.create(_shm_path(), 1, 8) as solo:
        out = torch.empty(1, 2, dtype=torch.float32)
        solo.all_gather(torch.tensor([1.5, -0.0]), out, 0.0)
        assert _bytes(out) == _bytes(torch.tensor([[1.5, -0.0]]))
        assert solo.broadcast(b"abc", 0.0) == b"abc"


def test_calls_out_of_step_are_refused() -> None:
    c0, c1 = _pair()
    try:
        r = _on_threads(lambda: c0.all_gather(torch.zeros(1), torch.zeros(2, 1), 5.0),
                        lambda: c1.all_gather(torch.zeros(2), torch.zeros(2, 2), 5.0))
        assert isinstance(r[0], CommMismatch) and "rank(s) [1]" in str(r[0]), r
        assert isinstance(r[1], CommMismatch) and "rank(s) [0]" in str(r[1]), r
    finally:
        c1.close()
        c0.close()
    c0, c1 = _pair()
    try:
        r = _on_threads(lambda: c0.broadcast(b"x", 5.0), lambda: c1.all_gather(torch.zeros(1), torch.zeros(2, 1), 5.0))
        assert r[0] == b"x" and isinstance(r[1], CommMismatch) and "rank(s) [0]" in str(r[1]), r
    finally:
        c1.close()
        c0.close()


def test_bad_arguments_are_refused_by_name(tmp_path: Path) -> None:
    path = _shm_path()
    for kw, name in (({"world": 0}, "world"), ({"world": 65}, "world"), ({"slot_bytes": 0}, "slot_bytes"),
                     ({"world": True}, "world")):
        args: dict[str, Any] = {"path": path, "world": 2, "slot_bytes": 64} | kw
        with pytest.raises(ValueError, match=name):
            ShmComm.create(**args)
    assert not os.path.exists(path)
    with pytest.raises(CommTimeout, match="rank 0 did not make"):  # nobody creates it
        ShmComm.attach(path, 2, 1, 64, 0.2)
    c0, c1 = _pair(slot_bytes=64)
    try:
        for rank in (0, 2, -1):
            with pytest.raises(ValueError, match="rank"):
                ShmComm.attach(c0.path, 2, rank, 64, 1.0)
        with pytest.raises(ValueError, match=r"world=3 but the segment .* world=2"):
            ShmComm.attach(c0.path, 3, 1, 64, 1.0)
        with pytest.raises(ValueError, match=r"slot_bytes=128 but the segment .* slot_bytes=64"):
            ShmComm.attach(c0.path, 2, 1, 128, 1.0)
        with pytest.raises(FileExistsError):
            ShmComm.create(c0.path, 2, 64)
        ok = torch.zeros(4)
        for src, out, name in ((torch.zeros(17), torch.zeros(2, 17), "src has 68 bytes, more than slot_bytes=64"),
                               (torch.zeros(4, 2).t(), torch.zeros(2, 2, 4), "src must be a contiguous"),
                               (torch.zeros(4, device="meta"), torch.zeros(2, 4), "src must be a CPU tensor"),
                               (ok, torch.zeros(2, 4, device="meta"), "out must be a CPU tensor"),
                               (ok, torch.zeros(2, 8)[:, ::2], "out must be a contiguous"),
                               (ok, torch.zeros(3, 4), r"out must have shape \[2, 4\]"),
                               (ok, torch.zeros(2, 4, dtype=torch.float64), "out must have src's dtype"),
                               ([0.0] * 4, torch.zeros(2, 4), "src must be a torch.Tensor")):
            with pytest.raises(ValueError, match=name):
                c0.all_gather(src, out, 1.0)  # type: ignore[arg-type]
        for t in (-1.0, float("inf"), float("nan"), "1"):
            with pytest.raises(ValueError, match="timeout_s"):
                c0.all_gather(ok, torch.zeros(2, 4), t)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="data must be bytes on rank 0"):
            c0.broadcast(None, 1.0)
        with pytest.raises(ValueError, match="data has 65 bytes, more than slot_bytes=64"):
            c0.broadcast(b"x" * 65, 1.0)
        with pytest.raises(ValueError, match="data must be None on rank 1"):
            c1.broadcast(b"x", 1.0)
        # nothing refused took a call: the pair is still in step
        assert _on_threads(lambda: c0.broadcast(b"ok", 5.0), lambda: c1.broadcast(None, 5.0)) == [b"ok", b"ok"]
    finally:
        c1.close()
        c0.close()
        c0.close()  # idempotent
    assert not os.path.exists(c0.path)
    with pytest.raises(RuntimeError, match="closed"):
        c0.broadcast(b"", 1.0)
    junk = tmp_path / "junk"
    junk.write_bytes(b"\1" * 4096)
    with pytest.raises(ValueError, match="not a comm segment"):
        ShmComm.attach(str(junk), 2, 1, 64, 1.0)


def test_a_segment_larger_than_dev_shm_fails_at_create() -> None:
    path = _shm_path()
    with pytest.raises(OSError, match=r"cannot create a .*-byte comm segment") as e:
        ShmComm.create(path, 64, 1 << 40)  # ~140 TB: fallocate refuses it now, not a SIGBUS later
    assert e.value.filename == path and not os.path.exists(path)


if __name__ == "__main__" and sys.argv[1:2] == ["worker"]:
    _worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
