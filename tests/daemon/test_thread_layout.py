"""A worker's threads: on our CPU kernels, the kernels get the threads and
torch's own ops one (kernels/cpu.own_threads); everywhere else torch keeps
its count. And tokens do not depend on the layout."""

from __future__ import annotations

import argparse

import pytest
import torch

from superfluid.daemon.worker import thread_layout
from superfluid.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the CPU kernels were not built")


@pytest.fixture(autouse=True)
def _restore():
    before = (torch.get_num_threads(), cpu._threads_set)
    yield
    cpu.restore_threads(before)


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"fake": False, "threads": 0, "backend": "torch", "model": None, **kw})


def test_the_kernels_take_the_threads_and_torch_keeps_one(monkeypatch):
    monkeypatch.delenv("SUPERFLUID_CPU_KERNELS", raising=False)
    torch.set_num_threads(2)
    thread_layout(_args())
    assert (cpu.threads(), torch.get_num_threads()) == (2, 1)
    thread_layout(_args(threads=3))  # --threads: the kernels' count
    assert (cpu.threads(), torch.get_num_threads()) == (3, 1)


@pytest.mark.parametrize("kw", [{"fake": True}, {"backend": "triton"}], ids=["fake", "triton"])
def test_elsewhere_torch_keeps_its_count(kw):
    torch.set_num_threads(2)
    cpu.set_threads(None)
    thread_layout(_args(**kw))
    assert (cpu.threads(), torch.get_num_threads()) == (2, 2)  # negative control for the test above


def test_the_pure_torch_path_keeps_torchs_threads(monkeypatch):
    monkeypatch.setenv("SUPERFLUID_CPU_KERNELS", "0")
    torch.set_num_threads(2)
    cpu.set_threads(None)
    thread_layout(_args())
    assert torch.get_num_threads() == 2


def test_restore_threads_undoes_own_threads():
    torch.set_num_threads(2)
    cpu.set_threads(None)
    before = cpu.own_threads(2)
    assert (cpu.threads(), torch.get_num_threads()) == (2, 1)
    cpu.restore_threads(before)
    assert (cpu._threads_set, torch.get_num_threads()) == (None, 2)


def test_tokens_do_not_depend_on_the_layout():
    from superfluid.client.local import LocalClient
    from superfluid.client.planner import Planner
    from superfluid.engine import load
    from superfluid.engine.tiny import default_model_dir
    from superfluid.executor import Executor

    def run() -> list[list[int]]:
        planner = Planner(LocalClient(Executor(load(str(default_model_dir()), "torch"))), prefill_token_budget=64)
        ids = [planner.submit([3 + i, 9, 27, 4 + 2 * i] * (3 + i), 12, stop_at_eos=False) for i in range(6)]
        rep = planner.run_until_done(120)
        return [rep.results[i].tokens for i in ids]

    torch.set_num_threads(2)
    cpu.set_threads(None)
    plain = run()
    cpu.own_threads()
    assert run() == plain
    assert all(len(t) == 12 for t in plain)
