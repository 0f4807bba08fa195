"""engine/blocks.py: the one block allocator under the KV pool, the fake and the Mamba2 slots."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from superfluid.engine.blocks import BlockPool
from superfluid.engine.runtime import CapacityError


@dataclasses.dataclass
class H:
    blocks: list[int]
    length: int = 0


def test_ids_lowest_first_and_the_last_freed_next():
    p = BlockPool(6, page=4)
    assert p.alloc(3) == [1, 2, 3]  # block 0 is the trash block
    p.decref([2])
    assert p.alloc(2) == [2, 4]
    assert (p.n_used, p.n_free) == (4, 1)
    with pytest.raises(CapacityError, match="2 blocks wanted, 1 free"):
        p.alloc(2)


def test_a_grow_that_runs_out_changes_nothing():
    """The copy-on-write block and the new ones are taken together: short of
    room, the holder keeps its blocks and the shared one keeps its count."""
    p = BlockPool(4, page=4)
    a = H(p.alloc(1), 2)
    b = H(list(a.blocks), 2)
    p.incref(b.blocks)  # b shares a's partial block
    before = (list(b.blocks), list(p.refs), p.n_free)
    assert p.grow_cost(b, 9) == 3 > p.n_free  # a copy of the shared block + 2 more
    with pytest.raises(CapacityError):
        p.grow(b, 9)
    assert (b.blocks, p.refs, p.n_free) == before
    # Negative control: with room the same grow swaps the shared block for a copy.
    moved = p.grow(b, 5)
    assert moved == (a.blocks[0], b.blocks[0]) and b.blocks[0] != a.blocks[0]
    assert p.refs[a.blocks[0]] == 1


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("agcd"), st.integers(0, 5), st.integers(0, 9)), max_size=40))
def test_counts_add_up(ops):
    """Whatever holders do, every block is free or held as often as its count says."""
    p = BlockPool(12, page=3)
    hs: list[H] = []
    for op, i, n in ops:
        try:
            if op == "a":
                hs.append(H(p.alloc(p.blocks_for(n)), n))
            elif op == "g" and hs:
                h = hs[i % len(hs)]
                if p.grow_cost(h, n) <= p.n_free:
                    p.grow(h, n)
                    h.length += n
            elif op == "c" and hs:
                src = hs[i % len(hs)]
                m = min(n, src.length)
                hs.append(H(p.prefix(src, m), m))
            elif op == "d" and hs:
                p.decref(hs.pop(i % len(hs)).blocks)
        except CapacityError:
            pass
        held: dict[int, int] = {}
        for h in hs:
            assert len(h.blocks) == p.blocks_for(h.length)
            for blk in h.blocks:
                held[blk] = held.get(blk, 0) + 1
        assert all(p.refs[blk] == c for blk, c in held.items())
        assert p.n_used == len(held)
    assert p.released_by(hs) == p.n_used
