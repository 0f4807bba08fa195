"""cpu.park(): the kernels' helper threads sleep between ticks (a worker
parks them when its tick is over). Jobs after parks wake them, finish, and
give the same bits (a lost wake-up would still finish: the caller runs the
tasks no helper took)."""

from __future__ import annotations

import pytest
import torch

from superfluid.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels are not built")


@pytest.fixture
def two_threads():
    before = (torch.get_num_threads(), cpu._threads_set)
    cpu.set_threads(2)
    yield
    cpu.restore_threads(before)


def test_jobs_after_a_park_give_the_same_bits(two_threads):
    torch.manual_seed(3)
    p = cpu.pack(torch.randn(512, 384))
    x = torch.randn(64, 384)
    ref = cpu.linear(x, p)
    for i in range(200):
        if i % 2:
            cpu.park()
        assert torch.equal(cpu.linear(x, p), ref)
