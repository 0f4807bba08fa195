"""Edges of the paged transformer runtime: what a block's former owner left
never reaches its next one, bad input is a typed error that changes
nothing, and copy-on-write is charged only where a copy happens."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from superfluid.engine import Feed, SampleSpec, load
from superfluid.engine.runtime import CapacityError, OutOfBounds
from superfluid.engine.tiny import write_tiny
from superfluid.engine.transformer import _EXPORT_HEAD


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("edges")
    write_tiny(d, seed=0, tokenizer=False, vocab_size=96, hidden_size=32, intermediate_size=64, num_heads=4,
               num_kv_heads=2, max_position_embeddings=256)
    return d


def _rt(ckpt, **kw):
    return load(ckpt, "torch", **{"kv_cells": 64, "page": 4, "max_batch": 16, **kw})


def _fresh_row(ckpt, tokens):
    r = _rt(ckpt)
    return r.step([Feed(r.seq_create(), tokens, True)])[0]


def test_stale_non_finite_values_never_reach_a_blocks_next_owner(ckpt):
    r = _rt(ckpt)
    x = r.seq_create()
    r.step([Feed(x, [1, 2, 3, 4])])
    # what an fp16 overflow would leave in x's block
    (b,) = r.seqs[x].blocks
    r.pool.v[:, b] = float("inf")
    r.seq_free(x)
    y = r.seq_create()
    got = r.step([Feed(y, [5, 6], True)])[0]  # y takes that block; its cells 2-3 are past y's end
    assert r.seqs[y].blocks == [b]
    want = _fresh_row(ckpt, [5, 6])
    assert np.isfinite(got).all() and np.array_equal(got, want)


def test_an_import_of_non_finite_values_is_refused(ckpt):
    r = _rt(ckpt)
    x = r.seq_create()
    r.step([Feed(x, [1, 2, 3, 4])])
    blob = r.seq_export(x)
    head = _EXPORT_HEAD.unpack_from(blob)
    payload = np.frombuffer(blob[_EXPORT_HEAD.size:], dtype=np.float32).copy()
    payload[-1] = np.inf
    crc = zlib.crc32(payload.tobytes(), zlib.crc32(_EXPORT_HEAD.pack(*head[:8], 0, head[9])))
    bad = _EXPORT_HEAD.pack(*head[:8], crc, head[9]) + payload.tobytes()
    z = r.seq_create()
    used = r.mem_counters().cells_used
    with pytest.raises(OutOfBounds, match="non-finite"):
        r.seq_import(z, bad)
    assert r.seq_len(z) == 0 and r.mem_counters().cells_used == used
    assert r.seq_import(z, blob) == 4  # negative control: the good blob goes in
    with pytest.raises(OutOfBounds):
        r.seq_import(r.seq_create(), None)


def test_an_import_from_another_numeric_class_is_refused_by_name(ckpt):
    r = _rt(ckpt)
    assert r.desc.numeric_class == "fp32"
    x = r.seq_create()
    r.step([Feed(x, [1, 2, 3, 4])])
    blob = r.seq_export(x)
    head = _EXPORT_HEAD.unpack_from(blob)
    assert head[9].rstrip(b"\0") == b"fp32"
    crc = zlib.crc32(blob[_EXPORT_HEAD.size:], zlib.crc32(_EXPORT_HEAD.pack(*head[:8], 0, b"bf16-dot")))
    other = _EXPORT_HEAD.pack(*head[:8], crc, b"bf16-dot") + blob[_EXPORT_HEAD.size:]
    z = r.seq_create()
    with pytest.raises(OutOfBounds, match="numeric class 'bf16-dot'; this worker computes 'fp32'"):
        r.seq_import(z, other)
    assert r.seq_len(z) == 0
    assert r.seq_import(z, blob) == 4  # negative control: its own class goes in


@pytest.mark.parametrize("spec", [
    SampleSpec(top_k=1 << 64), SampleSpec(temperature=None), SampleSpec(rng_position=-1), SampleSpec(top_k=None),
    SampleSpec(top_p="x"),
])
def test_a_bad_sample_spec_is_refused_before_the_step(ckpt, spec):
    r = _rt(ckpt)
    s = r.seq_create()
    r.step([Feed(s, [1, 2, 3])])
    used = r.mem_counters().cells_used
    with pytest.raises(OutOfBounds, match="sample spec 0"):
        r.step_sampled([Feed(s, [4], True)], [spec])
    assert r.seq_len(s) == 3 and r.mem_counters().cells_used == used
    assert len(r.step_sampled([Feed(s, [4], True)], [SampleSpec()])) == 1


@pytest.mark.parametrize("tokens", [[1, None], [1, 2.5], [float("nan")], ["7"]])
def test_a_token_that_is_not_an_integer_is_refused(ckpt, tokens):
    r = _rt(ckpt)
    s = r.seq_create()
    with pytest.raises(OutOfBounds, match="not an integer"):
        r.step([Feed(s, tokens, True)])
    assert r.seq_len(s) == 0
    assert len(r.step([Feed(s, [np.int64(3), 4], True)])) == 1  # numpy integers are integers


@pytest.mark.parametrize("call", ["truncate", "copy"])
def test_a_cell_count_that_is_not_an_integer_is_refused(ckpt, call):
    r = _rt(ckpt)
    s = r.seq_create()
    r.step([Feed(s, [1, 2, 3])])
    with pytest.raises(OutOfBounds, match="integer"):
        if call == "truncate":
            r.seq_truncate(s, 2.5)
        else:
            r.seq_copy(s, r.seq_create(), None)
    assert r.seq_len(s) == 3


def test_two_holders_of_a_shared_partial_block_fed_together_copy_it_once(ckpt):
    # a and b share a partial last block; the pool then has one free block: the first
    # holder fed copies the block, the last writes it in place.
    r = _rt(ckpt, kv_cells=12)  # 3 blocks of 4
    a, b = r.seq_create(), r.seq_create()
    r.step([Feed(a, [1, 2, 3, 4, 5, 6])])  # 2 blocks
    r.seq_copy(a, b, 4)  # shares a's full first block
    r.seq_truncate(a, 2)  # a's last block is now partial and shared with b
    r.seq_truncate(b, 3)
    assert r.pool.n_free == 1 + 1 and r.seqs[a].blocks == r.seqs[b].blocks
    c = r.seq_create()
    r.step([Feed(c, [9, 9, 9])])  # take one free block: one left
    assert r.pool.n_free == 1
    rows = r.step([Feed(a, [7], True), Feed(b, [8], True)])
    assert len(rows) == 2 and r.pool.n_free == 0
    # the same as fed apart on a fresh runtime
    assert np.array_equal(rows[0], _fresh_row(ckpt, [1, 2, 7]))
    assert np.array_equal(rows[1], _fresh_row(ckpt, [1, 2, 3, 8]))
    # negative control: a third holder would need a second copy, and there is none
    with pytest.raises(CapacityError):
        r2 = _rt(ckpt, kv_cells=12)
        a, b, d = r2.seq_create(), r2.seq_create(), r2.seq_create()
        r2.step([Feed(a, [1, 2, 3, 4, 5, 6])])
        r2.seq_copy(a, b, 4)
        r2.seq_copy(a, d, 4)
        for s, n in ((a, 2), (b, 3), (d, 1)):
            r2.seq_truncate(s, n)
        r2.step([Feed(r2.seq_create(), [9, 9, 9, 9, 9])])  # 2 blocks: none free
        r2.step([Feed(a, [7]), Feed(b, [8]), Feed(d, [6])])


def test_decode_mirrors_stay_within_twice_the_pool_and_skip_padding(ckpt, monkeypatch):
    # A mirror pads every row to the longest sequence: one long lane among short
    # ones, or a pool too small for it, and the group reads the pool instead,
    # with the same rows. Mirrors belong to the pure-torch path (the CPU kernels
    # read the pool in place).
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", "0")
    def decode(kv_cells, lengths):
        r = _rt(ckpt, kv_cells=kv_cells)
        seqs = [r.seq_create() for _ in lengths]
        r.step([Feed(s, [1 + i] * n) for i, (s, n) in enumerate(zip(seqs, lengths))])
        rows = []
        for t in range(3):
            rows.append(r.step([Feed(s, [5 + t], True) for s in seqs]))
            assert r._mirrors.bytes <= 2 * r.pool.allocated_bytes
        return r, rows

    def same(a, b):
        assert len(a) == len(b) == 3 and all(len(ra) == len(rb) == 8 for ra, rb in zip(a, b))
        return all(np.array_equal(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))

    skewed = [150] + [3] * 7
    r, rows = decode(8192, skewed)
    assert r._mirrors.bytes == 0  # mostly padding: not mirrored, even with room
    even = [20] * 8
    big, rows_big = decode(8192, even)
    assert big._mirrors.bytes > 0  # negative control: an even group is mirrored
    small, rows_small = decode(256, even)  # 8 x 192 cells of mirror > twice 256 cells of pool
    assert small._mirrors.bytes == 0
    assert same(rows_small, rows_big)  # the gather path gives the mirror's rows, bitwise
    # negative control: the rows are not all alike (the comparison could not pass vacuously)
    assert not np.array_equal(rows_big[0][0], rows_big[0][1]) and not np.array_equal(rows[0][0], rows[0][1])
