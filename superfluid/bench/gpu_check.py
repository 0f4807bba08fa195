"""`make gpu-check`: the checks that need a CUDA GPU, as one bounded command.

On a machine where torch sees a GPU, with TRITON_INTERPRET unset (kernels
compiled, not interpreted), it runs in turn:

  kernels        pytest -q tests/kernels
  engine_triton  the oracle and invariance tests with SUPERFLUID_TEST_BACKEND=triton
  tp             tests/engine/test_tp_backends.py on the triton backend: TP=2
                 and TP=4 bitwise TP=1 (ranks sharing one GPU through host
                 copies; NCCL for TP=2 where there are two GPUs)
  bench          superfluid bench engine --device cuda --json

each under its own timeout and all under one total budget (default 520 s,
under 9 minutes with start-up), and writes one JSON: per part its exit
code, duration and last lines of output, and the bench's JSON. It exits 1
if a part failed. Without a GPU it writes and prints {"gpu": false, ...}
and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ENGINE_TESTS = ("tests/engine/test_oracle.py", "tests/engine/test_invariance.py",
                "tests/engine/test_invariance_wide.py", "tests/kernels/test_triton_engine.py")
TP_TESTS = "tests/engine/test_tp_backends.py"
TAIL_LINES = 40


def parts() -> list[tuple[str, list[str], dict[str, str], int]]:
    """(name, argv, extra environment, timeout s) of each part, in order."""
    py = sys.executable
    # -P: started from the checkout, its folders must not shadow installed packages.
    return [
        ("kernels", [py, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels"], {}, 150),
        ("engine_triton", [py, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", *ENGINE_TESTS],
         {"SUPERFLUID_TEST_BACKEND": "triton"}, 100),
        ("tp", [py, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", TP_TESTS],
         {"SUPERFLUID_TEST_BACKEND": "triton"}, 90),
        ("bench", [py, "-P", "-m", "superfluid", "bench", "engine", "--device", "cuda", "--json"], {}, 180),
    ]


def _tail(text: str, n: int = TAIL_LINES) -> list[str]:
    return text.splitlines()[-n:]


def run_part(argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    t0 = time.monotonic()
    # A session of its own, so a timeout ends the whole tree (pytest workers, compilers).
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = None
    return {"rc": rc, "timed_out": rc is None, "timeout_s": round(timeout),
            "duration_s": round(time.monotonic() - t0, 1), "stdout": out, "stderr": err}


def check(budget_s: float = 520.0) -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"gpu": False, "ok": True,
                "reason": "no CUDA GPU here (torch.cuda.is_available() is False): nothing was run"}
    import triton

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    report: dict[str, Any] = {"gpu": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                              "triton": triton.__version__, "budget_s": budget_s, "parts": {}, "bench": None}
    deadline = time.monotonic() + budget_s
    for name, argv, extra, timeout in parts():
        left = deadline - time.monotonic()
        if left < 10:
            report["parts"][name] = {"rc": None, "skipped": "total budget spent"}
            continue
        res = run_part(argv, {**env, **extra}, min(timeout, left))
        if name == "bench":
            try:
                report["bench"] = json.loads(res["stdout"])
                res["stdout"] = ""
            except json.JSONDecodeError:
                pass
        report["parts"][name] = {"argv": " ".join(argv[1:]), "env": extra, "rc": res["rc"],
                                 "timed_out": res["timed_out"], "timeout_s": res["timeout_s"],
                                 "duration_s": res["duration_s"],
                                 "tail": _tail("\n".join(filter(None, (res["stdout"], res["stderr"]))))}
    report["ok"] = all(p.get("rc") == 0 for p in report["parts"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m superfluid.bench.gpu_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gpu-check.json"), help="where the JSON goes")
    ap.add_argument("--budget", type=float, default=520.0, help="seconds for all parts together")
    args = ap.parse_args(argv)
    report = check(args.budget)
    text = json.dumps(report, indent=2)
    args.out.write_text(text + "\n")
    print(text, flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
