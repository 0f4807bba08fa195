"""A runtime states its numeric class (DESCRIBE's `numeric`), and state never
crosses classes: a bf16 model's cells exported by a worker of the bf16-dot
class are refused by one of the bf16-fma class, naming both, and taken by
one of its own class, which then continues them bitwise. On a CPU without
vdpbf16ps the bf16-dot class runs by fma: this test runs everywhere."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from superfluid.engine.loader import load
from superfluid.engine.runtime import Feed, OutOfBounds
from superfluid.engine.tiny import write_tiny
from superfluid.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("numeric") / "m", seed=3, hidden_size=96, intermediate_size=200)


def _load(path, numeric: str | None, dtype=torch.bfloat16):
    cpu.set_bf16_class(numeric)
    try:
        return load(path, "torch", device="cpu", dtype=dtype)
    finally:
        cpu.set_bf16_class(None)


def test_the_class_and_isa_are_described(ckpt):
    rt = _load(ckpt, None, torch.float32)
    assert (rt.desc.numeric_class, rt.desc.isa) == ("fp32", cpu.isa())
    assert _load(ckpt, "bf16-fma").desc.numeric_class == "bf16-fma"
    assert _load(ckpt, "bf16-dot").desc.numeric_class == "bf16-dot"
    assert _load(ckpt, None).desc.numeric_class == cpu.bf16_class()


def test_an_import_never_crosses_classes(ckpt):
    dot, fma, dot2 = _load(ckpt, "bf16-dot"), _load(ckpt, "bf16-fma"), _load(ckpt, "bf16-dot")
    prompt, more = [5, 9, 2, 7, 1, 3, 8], [4, 6]
    src = dot.seq_create()
    dot.step([Feed(src, prompt)])
    blob = dot.seq_export(src)
    want = dot.step([Feed(src, more, True)])[0]

    s = fma.seq_create()
    with pytest.raises(OutOfBounds, match="numeric class 'bf16-dot'; this worker computes 'bf16-fma'"):
        fma.seq_import(s, blob)
    assert fma.seq_len(s) == 0 and fma.mem_counters().cells_used == 0

    s2 = dot2.seq_create()
    assert dot2.seq_import(s2, blob) == len(prompt)
    assert np.array_equal(dot2.step([Feed(s2, more, True)])[0], want)  # same class: bitwise

    # The negative control: the classes' rows differ, so the refusal above guards something real.
    f = fma.seq_create()
    assert not np.array_equal(fma.step([Feed(f, prompt + more, True)])[0], want)
