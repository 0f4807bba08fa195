"""Tensor parallelism (engine/parallel): rows, tokens and exports are
bitwise those of TP=1 at TP=2 and TP=4, batched or alone, whatever the
threads; a plain all-reduce (the negative control) changes them."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from superfluid.engine import Feed, SampleSpec, load
from superfluid.engine.config import load_config
from superfluid.engine.parallel.sharding import Shard, TpError, reduction_parts, vocab_ranges
from superfluid.engine.tiny import write_tiny
from superfluid.kernels import cpu
from superfluid.testing.runtime_harness import play

pytestmark = pytest.mark.skipif(not cpu.available(), reason="tensor parallelism runs on the CPU kernels")

KV_CELLS = 2048


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny(tmp_path_factory.mktemp("tp") / "llama", seed=3))


@pytest.fixture(scope="module")
def runtimes(tiny):
    rts = {1: load(tiny, kv_cells=KV_CELLS),
           2: load(tiny, tp=2, kv_cells=KV_CELLS, tp_options=dict(transport="gloo")),
           4: load(tiny, tp=4, kv_cells=KV_CELLS, tp_options=dict(transport="gloo"))}
    yield rts
    for rt in rts.values():
        rt.close()


steps = st.lists(st.lists(st.integers(0, 319), min_size=1, max_size=12), min_size=1, max_size=4)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompts=steps, decode=st.lists(st.integers(0, 319), min_size=1, max_size=4), alone=st.booleans())
def test_rows_are_the_same_at_every_degree(runtimes, prompts, decode, alone):
    """Prefill then decode of several sequences, batched (or one at a time):
    every row of TP=2 and TP=4 is TP=1's, bit for bit."""
    script = [[(i, p) for i, p in enumerate(prompts)]]
    script += [[(i, [t]) for i in range(len(prompts))] for t in decode]
    if alone:
        script = [[f] for step in script for f in step]
    base = play(runtimes[1], script)
    for n in (2, 4):
        assert play(runtimes[n], script) == base, f"TP={n}"


def test_a_plain_all_reduce_changes_bits(tiny, runtimes):
    """The negative control: the same shards summed by all_reduce (the order
    gloo picks) do not give TP=1's rows, so the equality above is not vacuous."""
    script = [[(0, list(range(5, 45))), (1, [9, 8, 7])], [(0, [3]), (1, [4])]]
    rt = load(tiny, tp=2, kv_cells=KV_CELLS, tp_options=dict(transport="gloo", plain_reduce=True))
    try:
        plain = play(rt, script)
    finally:
        rt.close()
    assert plain != play(runtimes[1], script)


def test_small_shared_memory_slots(tiny, runtimes):
    """Steps whose pieces, logits and messages exceed the shared-memory slots
    go in several rounds (and the layers one op at a time): the same bits."""
    script = [[(0, list(range(5, 85))), (1, list(range(100, 140)))], [(0, [3]), (1, [4])]]
    rt = load(tiny, tp=2, kv_cells=KV_CELLS, tp_options=dict(slot_bytes=4096))
    try:
        small = play(rt, script)
    finally:
        rt.close()
    rt.close()  # again: nothing to stop
    assert small == play(runtimes[1], script)
    assert all(p.returncode == 0 for p in rt.followers)  # told to stop, they exited cleanly


def test_sampling_copies_and_exports_across_degrees(runtimes):
    """Sampled tokens, every-token rows, a copied prefix, and an export taken
    at TP=2 imported at TP=1 and TP=4: the same bits everywhere."""
    outs = {}
    for n, rt in runtimes.items():
        a, b = rt.seq_create(), rt.seq_create()
        rows = rt.step_rows([Feed(a, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]),
                             Feed(b, [40, 41])])
        spec = [SampleSpec(0.8, 20, 0.9, 0.0, 7), SampleSpec(0.0)]
        toks = rt.step_sampled([Feed(a, [19]), Feed(b, [42])], spec)
        c = rt.seq_create()
        rt.seq_copy(a, c, 17)  # a shared full block and a copied partial one
        after_copy = rt.step([Feed(c, [99], True), Feed(a, [toks[0]], True)])
        outs[n] = ([r.tobytes() for r in rows], toks, [r.tobytes() for r in after_copy], rt.seq_export(a))
        for s in (a, b, c):
            rt.seq_free(s)
    assert outs[2] == outs[1] and outs[4] == outs[1]
    blob = outs[2][3]
    cont = {}
    for n, rt in runtimes.items():
        s = rt.seq_create()
        rt.seq_import(s, blob)
        cont[n] = rt.step([Feed(s, [77], True)])[0].tobytes()
        rt.seq_free(s)
    assert cont[2] == cont[1] and cont[4] == cont[1]


@pytest.mark.parametrize("arch,dtype", [("qwen3", "float32"), ("qwen2", "bfloat16"), ("mistral", "float32")])
def test_architectures_and_bf16(tmp_path, arch, dtype):
    """Qwen3's q/k norms, Qwen2's q/k/v biases, Mistral, bf16 weights and KV, two threads a rank."""
    path = str(write_tiny(tmp_path / arch, arch=arch, seed=5, num_heads=4, num_kv_heads=4))
    script = [[(0, [5, 6, 7, 8, 9, 10, 11]), (1, [12])], [(0, [13]), (1, [14])]]
    one = load(path, kv_cells=256, dtype=dtype)
    two = load(path, tp=2, kv_cells=256, dtype=dtype, tp_options=dict(threads=2))
    try:
        assert play(two, script) == play(one, script)
    finally:
        one.close()
        two.close()


def test_a_rank_holds_its_shard_only(tiny, runtimes):
    """Weights are read shard by shard: a rank of TP=2 holds about half."""
    whole = runtimes[1].model.weight_bytes
    half = runtimes[2].model.weight_bytes
    assert half < 0.6 * whole
    assert runtimes[2].desc.tp == 2 and runtimes[4].desc.tp == 4 and runtimes[1].desc.tp == 1


def test_shards_and_refusals(tiny, tmp_path):
    cfg = load_config(tiny)  # 4 heads, 2 KV heads, 128 intermediate
    assert reduction_parts(cfg) == 4
    with pytest.raises(TpError, match="--tp 3"):
        Shard.plan(cfg, 3)
    with pytest.raises(TpError, match="--tp 16"):
        Shard.plan(cfg, 16)
    four = [Shard.plan(cfg, 4, r) for r in range(4)]
    assert [s.kv_heads for s in four] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]  # replicated
    assert [s.heads for s in four] == [range(r, r + 1) for r in range(4)]
    v = vocab_ranges(320, 4, 8)
    assert v[0].start == 0 and v[-1].stop == 320 and all(a.stop == b.start for a, b in itertools.pairwise(v))
    mamba = write_tiny(tmp_path / "m2", arch="mamba2")
    with pytest.raises(TpError, match="--tp 2"):
        load(mamba, tp=2)
    with pytest.raises(TpError, match="--tp 3"):
        load(tiny, tp=3)


def test_ranks_given_other_options_are_named_at_the_join():
    """Every rank all-gathers a digest of what it loaded and how: a rank with
    another one is named and nobody starts (the negative half: equal digests pass)."""
    import socket
    import threading

    from superfluid.engine.parallel.group import GlooLink, GroupFault

    def meet(digests: list[bytes]) -> list[object]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        out: list[object] = [None, None]

        def rank(r: int) -> None:
            link = GlooLink(f"tcp://127.0.0.1:{port}", 2, r, 5.0, 30.0)
            try:
                link.barrier(digests[r])
                out[r] = "ok"
            except GroupFault as e:
                out[r] = e
            finally:
                link.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out

    assert meet([b"same", b"same"]) == ["ok", "ok"]
    got = meet([b"mine", b"other"])
    assert all(isinstance(e, GroupFault) and "tp rank(s) [1]" in str(e) for e in got), got


LEADER = """
import sys, time
from superfluid.engine import Feed, load
rt = load(sys.argv[1], tp=2, kv_cells=256)
s = rt.seq_create()
rt.step([Feed(s, [1, 2, 3], True)])
print(" ".join(str(p.pid) for p in rt.followers), flush=True)
time.sleep(600)
"""


def test_followers_end_by_themselves_when_their_leader_dies(tiny, tmp_path):
    """No daemon to kill them: a follower sees its leader gone (it checks
    every second between steps) and exits; nothing is left in /dev/shm."""
    import signal
    import subprocess
    import sys
    import time

    before = {f for f in os.listdir("/dev/shm") if f.startswith("sf-tp-")}
    leader = subprocess.Popen([sys.executable, "-P", "-c", LEADER, tiny], stdout=subprocess.PIPE, text=True)
    try:
        line = leader.stdout.readline() if leader.stdout else ""
        followers = [int(p) for p in line.split()]
        assert followers, "the leader never served"
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait()
        t0 = time.monotonic()
        while any(_alive(p) for p in followers) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        assert not any(_alive(p) for p in followers)
        assert time.monotonic() - t0 < 3.0
    finally:
        leader.kill()
        leader.wait()
    assert {f for f in os.listdir("/dev/shm") if f.startswith("sf-tp-")} <= before


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


@pytest.mark.slow
def test_real_width_invariance(tmp_path):
    """At real widths (hidden 512, ffn 1536, vocab 32000, 8 heads): TP=2's
    rows are TP=1's, batched prefill and decode."""
    path = str(write_tiny(tmp_path / "wide", seed=1, vocab_size=32000, hidden_size=512, intermediate_size=1536,
                          num_layers=2, num_heads=8, num_kv_heads=4))
    rng = np.random.default_rng(0)
    script = [[(i, rng.integers(0, 32000, size=int(n)).tolist()) for i, n in enumerate((37, 5, 1, 20))]]
    script += [[(i, [int(rng.integers(0, 32000))]) for i in range(4)] for _ in range(2)]
    one = load(path, kv_cells=512)
    two = load(path, tp=2, kv_cells=512)
    try:
        assert play(two, script) == play(one, script)
    finally:
        one.close()
        two.close()
    torch.set_num_threads(torch.get_num_threads())
