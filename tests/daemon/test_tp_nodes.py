"""--tp across machines: two `serve` processes on 127.0.0.1 as two nodes
(node 0 the worker and rank 0, node 1 rank 1, meeting through gloo over
TCP). The tokens are those of a one-process worker; node 1's rank killed,
the group restarts on both and the requests still finish bitwise."""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable
from typing import Any

import pytest

from superfluid.abi import Sampling
from superfluid.abi.records import SamplingParams
from superfluid.kernels import cpu
from superfluid.testing.daemon import Serve, live_ranks, run_requests, wait_for

pytestmark = pytest.mark.skipif(not cpu.available(), reason="tensor parallelism runs on the CPU kernels")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(marker: str) -> list[int]:
    return live_ranks(marker.encode())


def _run(name: str, kill: Callable[[], None] | None = None) -> tuple[list[list[int]], int, Any]:
    reqs = [dict(prompt=[(11 * i + 5 * j) % 256 for j in range(18 + 7 * i)], max_new_tokens=12,
                 sampling=Sampling.GPU_SAMPLE if i % 2 else Sampling.GPU_GREEDY,
                 params=SamplingParams(temperature=0.8, top_k=40) if i % 2 else SamplingParams(),
                 rng_base=17 * (i + 1)) for i in range(3)]
    return run_requests(name, reqs, kill)


def test_two_nodes_give_one_process_tokens_and_restart_together(tmp_path):
    port = _free_port()
    tag = f"tpn{os.getpid()}"
    common = ("--max-batch", "8", "--tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port), "--tp-timeout", "5", "--restart-backoff", "0.05")
    one = Serve(tmp_path, f"{tag}one", "--max-batch", "8")
    node0 = Serve(tmp_path, f"{tag}n0", *common, "--node-rank", "0")
    node1 = Serve(tmp_path, f"{tag}n1", *common, "--node-rank", "1")
    try:
        one.wait_log("worker 0 ready (epoch 1")
        want, _, par = _run(one.name)
        assert (par.tp, par.nnodes) == (1, 1) and all(want)
        node0.wait_log("worker 0 ready (epoch 1")
        got, restarts, par = _run(node0.name)
        assert (par.tp, par.nnodes) == (2, 2)
        assert restarts == 0 and got == want
        # --tp 2 over 2 nodes: node 0 runs the worker alone, node 1 exactly rank 1.
        remote = _ranks(f"--master-port\x00{port}")
        assert len(remote) == 1, "node 1 runs exactly rank 1"

        def kill() -> None:
            os.kill(remote[0], signal.SIGKILL)

        got, restarts, _ = _run(node0.name, kill)
        assert restarts >= 1 and got == want
        wait_for(lambda: "restarting this node's ranks" in node1.log or "tp rank 1 started" in node1.log, "node 1")
    finally:
        for s in (node1, node0, one):
            if s.proc.poll() is None:
                s.proc.send_signal(signal.SIGTERM)
                try:
                    s.proc.wait(20)
                except Exception:  # noqa: BLE001 - close() kills it
                    pass
            s.close()
    wait_for(lambda: not _ranks(f"--master-port\x00{port}"), "every rank to end", 10)
