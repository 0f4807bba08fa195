"""A decode step's TokenMasks out of the round's bitmask (executor/decode.py):
the rows as a view when the step's grammar lanes hold consecutive rows, else
gathered; mask rows named only when some feed of the step has no grammar. And
GrammarRegistry.fill writes the same masks in this thread as on the pool."""

from __future__ import annotations

import json

import numpy as np

from superfluid.engine.tiny import write_tiny
from superfluid.executor.decode import DecodePhase
from superfluid.executor.grammar import GrammarRegistry


def test_consecutive_rows_are_a_view_and_others_are_gathered():
    bits = np.arange(5 * 3, dtype=np.int32).reshape(5, 3)
    tm = DecodePhase._token_masks(bits, {10: 1, 11: 2, 12: 3}, [10, 11, 12])
    assert tm.rows is None and np.shares_memory(tm.bits, bits) and tm.bits.tolist() == bits[1:4].tolist()
    tm = DecodePhase._token_masks(bits, {10: 0, 12: 1}, [10, 99, 12])  # a lane without a grammar between
    assert tm.rows == [0, 2] and np.shares_memory(tm.bits, bits) and tm.bits.tolist() == bits[0:2].tolist()
    tm = DecodePhase._token_masks(bits, {10: 0, 12: 2, 13: 4}, [13, 10, 12])  # row 1's lane faulted, order differs
    assert tm.rows is None and not np.shares_memory(tm.bits, bits)
    assert tm.bits.tolist() == bits[[4, 0, 2]].tolist()
    assert DecodePhase._token_masks(bits, {10: 0}, [98, 99]) is None


def test_fill_in_this_thread_equals_the_pools(tmp_path):
    d = write_tiny(tmp_path / "m", seed=1)
    tok = (d / "tokenizer.json").read_text()
    V, eos = 320, (257, 259)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                         "required": ["a", "b"]})
    here, pool = GrammarRegistry(tok, V, eos, threads=1), GrammarRegistry(tok, V, eos, threads=2)
    assert here.threads == 1 and pool.threads == 2
    text = b'{"a":12,"b":"xy"}'
    ms_here = [here.compile("json_schema", schema).matcher(text[:k]) for k in range(0, 12, 3)]
    ms_pool = [pool.compile("json_schema", schema).matcher(text[:k]) for k in range(0, 12, 3)]
    a, b = here.bitmask(len(ms_here), fill=False), pool.bitmask(len(ms_pool), fill=False)
    assert here.fill([(m, j) for j, m in enumerate(ms_here)], a) == []
    assert pool.fill([(m, j) for j, m in enumerate(ms_pool)], b) == []
    assert np.array_equal(a, b) and len({r.tobytes() for r in a}) > 1
    ms_here[1]._m.consume_token(ord("}"))  # llguidance's permanent error state, from outside
    ms_pool[1]._m.consume_token(ord("}"))
    assert here.fill([(m, j) for j, m in enumerate(ms_here)], a) == [1]
    assert pool.fill([(m, j) for j, m in enumerate(ms_pool)], b) == [1]
