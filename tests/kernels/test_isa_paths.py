"""The kernels' ISA paths and numeric classes (kernels/sf_gemm_wide.c,
sf_gemm_dot.c).

float32 and the bf16-fma class give the same bits on every path (scalar,
AVX2, AVX-512); the bf16-dot class gives the same bits natively (vdpbf16ps)
and by fma on the lower paths; the bf16-amx class (AMX tiles, its path
only) is batch and thread invariant and within float32 rounding of its sum.
Each path runs here only where the CPU has it; a missing one skips naming
the flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from superfluid.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")

BEST = cpu.ISA_LEVELS.get(cpu.best_isa(), 0)
FLAG = {"avx2": "avx2 and fma", "avx512": "avx512f/dq/bw/vl", "avx512-bf16": "avx512_bf16",
        "amx-bf16": "amx_bf16 and amx_tile with the OS's tile state (or its kernel failed its check)"}


def need(path: str) -> None:
    if cpu.ISA_LEVELS[path] > BEST:
        pytest.skip(f"this CPU lacks {FLAG[path]} (cpuid): the {path} path cannot run here")


def on(level: int, fn):
    cpu.force_isa(level)
    try:
        return fn()
    finally:
        cpu.force_isa(None)


CLASSES = [(torch.float32, None), (torch.bfloat16, "bf16-fma"), (torch.bfloat16, "bf16-dot")]
AMX = cpu.ISA_LEVELS["amx-bf16"] <= BEST


@pytest.mark.parametrize("dtype,numeric", CLASSES)
@pytest.mark.parametrize("path", ["avx2", "avx512", "avx512-bf16", "amx-bf16"])
def test_each_class_gives_the_same_bits_on_every_path(dtype, numeric, path):
    need(path)
    torch.manual_seed(5)
    for out, inp, n in ((37, 19, 3), (1100, 1537, 101), (48, 600, 40)):  # odd K, panel edges, tile tails
        w, b = torch.randn(out, inp).to(dtype), torch.randn(out)
        p = cpu.pack(w, b, numeric=numeric)
        x = torch.randn(n, inp)
        top = on(cpu.ISA_LEVELS[path], lambda: cpu.linear(x, p))
        for lower in range(cpu.ISA_LEVELS[path]):
            assert torch.equal(on(lower, lambda: cpu.linear(x, p)), top), (out, inp, cpu.ISA_NAMES[lower])
        assert not torch.equal(top[0], top[1])


@pytest.mark.parametrize("dtype,numeric", CLASSES + ([(torch.bfloat16, "bf16-amx")] if AMX else []))
@pytest.mark.parametrize("parts", [1, 8])
def test_a_lone_row_is_its_batch_row_on_every_path(dtype, numeric, parts):
    """A decode step's GEMV (one token: four panels' chains at a time, each
    panel's pieces streamed in order) gives the rows the batched tiles give
    (five tokens, more than a few: tasks split by piece),
    on every path of the class, at a model's widths (69 panels: groups of
    four and a tail; 8 pieces as o_proj and down_proj reduce)."""
    torch.manual_seed(11)
    out, inp = 1100, 1536
    w, b = torch.randn(out, inp).to(dtype), torch.randn(out)
    x = torch.randn(5, inp)
    if parts > 1:
        p = cpu.pack_parts(w, parts, numeric=numeric)
        run = (lambda xx: cpu.linear_parts(xx, p))  # noqa: E731
    else:
        p = cpu.pack(w, b, numeric=numeric)
        run = (lambda xx: cpu.linear(xx, p)[None])  # noqa: E731
    full = run(x)
    assert not torch.equal(full[:, 0], full[:, 1])
    paths = [BEST] if numeric == "bf16-amx" else range(BEST + 1)
    for level in paths:
        for t in (0, 2, 4):
            assert torch.equal(on(level, lambda: run(x[t:t + 1]))[:, 0], full[:, t]), (cpu.ISA_NAMES[level], t)
        # a few tokens (up to 4: tasks take every piece of their panels) against the five-token call
        assert torch.equal(on(level, lambda: run(x[1:4])), full[:, 1:4]), cpu.ISA_NAMES[level]


def test_the_classes_differ():
    """The negative control: the bf16 classes round differently, so an
    equality between paths of one class is not an equality of everything."""
    torch.manual_seed(6)
    w, x = torch.randn(64, 512).to(torch.bfloat16), torch.randn(8, 512)
    fma = cpu.linear(x, cpu.pack(w, numeric="bf16-fma"))
    dot = cpu.linear(x, cpu.pack(w, numeric="bf16-dot"))
    assert not torch.equal(fma, dot)
    assert (fma - dot).abs().max() < 0.5  # the same product, to bf16's precision


@pytest.mark.parametrize("numeric", ["bf16-fma", "bf16-dot", "bf16-amx"])
def test_a_class_matches_its_definition_in_float64(numeric):
    if numeric == "bf16-amx":
        need("amx-bf16")
    torch.manual_seed(7)
    w, b, x = torch.randn(300, 777).to(torch.bfloat16), torch.randn(300), torch.randn(33, 777)
    got = cpu.linear(x, cpu.pack(w, b, numeric=numeric)).double()
    xs = x.to(torch.bfloat16) if numeric != "bf16-fma" else x  # dot and amx round activations to bf16
    ref = xs.double() @ w.double().T + b.double()
    assert (got - ref).abs().max() < 2e-6 * 777 ** 0.5 * 8


@settings(max_examples=25, deadline=None)
@given(out=st.integers(1, 80), inp=st.integers(1, 300), n=st.integers(1, 110), threads=st.integers(1, 3),
       cls=st.sampled_from(CLASSES + ([(torch.bfloat16, "bf16-amx")] if AMX else [])),
       parts=st.sampled_from([1, 2, 3]), seed=st.integers(0, 2**16))
def test_rows_are_batch_thread_and_path_invariant_within_a_class(out, inp, n, threads, cls, parts, seed):
    dtype, numeric = cls
    inp = inp * parts
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g).to(dtype)
    x = torch.randn(n, inp, generator=g)
    p = cpu.pack_parts(w, parts, numeric=numeric) if parts > 1 else cpu.pack(w, numeric=numeric)
    run = (lambda xx: cpu.linear_parts(xx, p)) if parts > 1 else (lambda xx: cpu.linear(xx, p)[None])
    before = cpu.threads()
    try:
        cpu.set_threads(threads)
        full = run(x)
        at = n // 2
        assert torch.equal(run(x[at:at + 1])[:, 0], full[:, at])
        if numeric != "bf16-amx":  # (that class has one path)
            for lower in range(BEST):
                assert torch.equal(on(lower, lambda: run(x)), full), cpu.ISA_NAMES[lower]
    finally:
        cpu.set_threads(before)


def test_the_amx_class_runs_on_its_path_only():
    if not AMX:
        with pytest.raises(ValueError, match="runs only on the amx-bf16 path"):
            cpu.set_bf16_class("bf16-amx")
        need("amx-bf16")
    torch.manual_seed(8)
    p = cpu.pack(torch.randn(40, 96).to(torch.bfloat16), numeric="bf16-amx")
    x = torch.randn(3, 96)
    with pytest.raises(RuntimeError, match="only on the amx-bf16 path"):
        on(cpu.ISA_LEVELS["avx512-bf16"], lambda: cpu.linear(x, p))
    assert torch.isfinite(cpu.linear(x, p)).all()


def test_a_path_above_the_cpu_or_unknown_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown ISA path 'avx1024'"):
        cpu.force_isa("avx1024")
    if cpu.ISA_LEVELS["avx512-bf16"] > BEST:
        with pytest.raises(ValueError, match="above this CPU's best"):
            cpu.force_isa("avx512-bf16")
    with pytest.raises(ValueError, match="SUPERFLUID_ISA=sse9"):
        cpu.configure_from_env({"SUPERFLUID_ISA": "sse9"})
    with pytest.raises(ValueError, match="SUPERFLUID_BF16_CLASS=bf17"):
        cpu.configure_from_env({"SUPERFLUID_BF16_CLASS": "bf17"})
    try:
        cpu.configure_from_env({"SUPERFLUID_ISA": "scalar"})
        assert cpu.isa() == "scalar"
    finally:
        cpu.force_isa(None)
    assert cpu.isa() == cpu.best_isa()


def test_the_class_follows_the_path_unless_pinned():
    try:
        cpu.force_isa("avx2" if BEST >= 1 else "scalar")
        assert cpu.bf16_class() == "bf16-fma"
        cpu.set_bf16_class("bf16-dot")
        assert cpu.bf16_class() == "bf16-dot" and cpu.numeric_class(torch.bfloat16) == "bf16-dot"
        assert cpu.pack(torch.ones(3, 4, dtype=torch.bfloat16)).numeric_class == "bf16-dot"
    finally:
        cpu.force_isa(None)
        cpu.set_bf16_class(None)
    assert cpu.numeric_class(torch.float32) == "fp32"
    assert cpu.bf16_class() == ("bf16-amx" if AMX else
                                "bf16-dot" if cpu.ISA_LEVELS["avx512-bf16"] <= BEST else "bf16-fma")


def test_the_dot_class_rounds_activations_as_torch_does_on_every_path():
    """x through an identity in the bf16-dot class is x rounded to bf16 (ties
    to even; denormals taken as zero, as vdpbf16ps takes them): the vector
    conversion of every path against torch's."""
    torch.manual_seed(9)
    k = 40
    base = (torch.randn(6, k) * torch.logspace(-30, 30, k)).to(torch.bfloat16).float()  # on the bf16 grid
    ulp = torch.tensor(2.0).pow(torch.floor(torch.log2(base.abs())) - 7)  # a bf16 ulp of each value
    x = torch.cat([base, base + ulp / 2, base - ulp / 2, torch.full((1, k), 1e-39)])  # exact ties, denormals
    assert not torch.equal(x[6:12].to(torch.bfloat16).float(), base)  # some ties round away from base
    want = x.to(torch.bfloat16).float()
    want = torch.where(want.abs() < 2.0 ** -126, torch.zeros_like(want), want)
    p = cpu.pack(torch.eye(k, dtype=torch.bfloat16), numeric="bf16-dot")
    for level in range(BEST + 1):
        if level == cpu.ISA_LEVELS["amx-bf16"]:
            continue  # (the dot class runs on vdpbf16ps there)
        got = on(level, lambda: cpu.linear(x, p))
        nonzero = want != 0  # (a flushed term's zero may carry either sign)
        assert torch.equal(got[nonzero], want[nonzero]) and not got[~nonzero].any(), cpu.ISA_NAMES[level]


def _dot_class_reference(x: torch.Tensor, w: torch.Tensor, odd_first: bool = True) -> torch.Tensor:
    """The bf16-dot class computed in numpy float32, one rounding an add: x
    rounded to bf16, per pair of steps acc + x[2i+1] w[2i+1] then + x[2i]
    w[2i] (a product of two bf16 is exact in float32, so each add is the
    instruction's fma). Inputs chosen with no denormal or overflowing term."""
    xb = x.to(torch.bfloat16).float().numpy()
    wb = w.float().numpy()
    k = xb.shape[1]
    acc = np.zeros((xb.shape[0], wb.shape[0]), dtype=np.float32)
    for i in range(0, k, 2):
        order = (i + 1, i) if odd_first else (i, i + 1)
        for j in order:
            if j < k:
                acc = (acc + np.outer(xb[:, j], wb[:, j]).astype(np.float32)).astype(np.float32)
    return torch.from_numpy(acc)


@pytest.mark.parametrize("k", [64, 77])
def test_the_dot_class_is_its_definition_on_every_path(k):
    """Every path that computes bf16-dot against the definition written out
    in numpy, bit for bit, on any CPU (vdpbf16ps where present); the even-
    step-first order is the negative control: it differs somewhere."""
    torch.manual_seed(10)
    x, w = torch.randn(9, k), torch.randn(33, k).to(torch.bfloat16)
    want = _dot_class_reference(x, w)
    assert not torch.equal(_dot_class_reference(x, w, odd_first=False), want)
    p = cpu.pack(w, numeric="bf16-dot")
    for level in range(min(BEST, cpu.ISA_LEVELS["avx512-bf16"]) + 1):
        assert torch.equal(on(level, lambda: cpu.linear(x, p)), want), cpu.ISA_NAMES[level]
