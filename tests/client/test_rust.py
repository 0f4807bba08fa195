"""The Rust planner crate (client/rust): generated declarations up to date
with the header, `cargo test` against live daemons (its planner against the
Python one, token for token), and the README's example run."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from superfluid.abi import gen_bindings
from superfluid.testing.daemon import Serve
from superfluid.testing.launch import python

ROOT = Path(__file__).resolve().parents[2]
CRATE = ROOT / "client" / "rust"
TESTS = 23  # unit 9, tests/live.rs 3, tests/faults.rs 2, tests/planner.rs 5, tests/grammar.rs 2, tests/speculation.rs 2


def test_the_generated_bindings_match_the_header():
    assert gen_bindings.main(["--check"]) == 0


def _cargo() -> None:
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed: the Rust crate is not built here")
    for crate in ("rmp-serde", "serde_json"):
        if not glob.glob(f"/usr/share/cargo/registry/{crate}-*"):
            pytest.skip(f"Debian's crate {crate} (librust-*-dev) is not installed: .ci/run installs it")


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cargo-target")


@pytest.mark.timeout(900)  # a fresh build, then every live test in turn (a few minutes on two cores)
def test_cargo_test_against_live_daemons(tmp_path, target):
    _cargo()
    env = dict(os.environ, SUPERFLUID_PYTHON=sys.executable, CARGO_TARGET_DIR=str(target),
               SUPERFLUID_SHM_DIR=str(tmp_path))
    r = subprocess.run(["cargo", "test", "--offline", "--quiet"], cwd=CRATE, env=env, capture_output=True, text=True,
                       timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    passed = sum(int(n) for n in re.findall(r"test result: ok\. (\d+) passed", r.stdout))
    assert passed == TESTS and "SUPERFLUID_PYTHON is not set" not in out, out[-6000:]


def test_the_readme_example_is_the_file_and_runs(tmp_path_factory, target):
    example = (CRATE / "examples" / "readme.rs").read_text()
    assert f"```rust\n{example}```" in (ROOT / "README.md").read_text(), "README's Rust example != examples/readme.rs"
    _cargo()
    d = Serve(tmp_path_factory.mktemp("rs-readme"), f"rsreadme{os.getpid()}", "--fake")
    try:
        d.wait_log("worker 0 ready (epoch 1")
        env = dict(os.environ, CARGO_TARGET_DIR=str(target))  # the daemon's SUPERFLUID_SHM_DIR too
        r = subprocess.run(["cargo", "run", "--offline", "--quiet", "--example", "readme", "--", d.name], cwd=CRATE,
                           env=env, capture_output=True, text=True, timeout=600)
    finally:
        d.close()
    assert r.returncode == 0, r.stderr[-4000:]
    lines = r.stdout.splitlines()
    assert lines[0] == "fake (vocab 512), eos [511]" and len(lines) == 3, r.stdout
    assert all(re.fullmatch(r"request \d: \[[\d, ]+\] \((max_tokens|eos)\)", ln) for ln in lines[1:]), r.stdout


def test_the_wheel_puts_the_rust_planner_on_path_and_it_gets_pythons_tokens(tmp_path, tmp_path_factory):
    """maturin packs the crate's binaries (bindings = "bin"); pip installs
    them; the installed superfluid-plan answers a workload as `superfluid
    plan` does."""
    _cargo()
    maturin = shutil.which("maturin") or str(Path(sys.executable).with_name("maturin"))
    if not os.path.exists(maturin):
        pytest.skip("maturin is not installed (it is in the [test] extras)")
    # The release build `bench ring` makes (tests/bench ran it): its compiled crates serve again.
    release = os.environ.get("CARGO_TARGET_DIR") or str(CRATE / "target")
    env = dict(os.environ, CARGO_TARGET_DIR=release)
    r = subprocess.run([maturin, "build", "--offline", "--release", "-o", str(tmp_path / "wheels")], cwd=CRATE,
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    (wheel,) = (tmp_path / "wheels").glob("superfluid_planner-*.whl")
    r = subprocess.run([*python(), "-m", "pip", "install", "-q", "--no-deps", "--target", str(tmp_path / "site"),
                        str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    plan = tmp_path / "site" / "bin" / "superfluid-plan"
    assert os.access(plan, os.X_OK) and os.access(plan.with_name("superfluid-bench"), os.X_OK)
    workload = {"requests": [{"prompt": [5, 6, 7, 8, 9], "max_new_tokens": 10},
                             {"prompt": [1, 2, 3], "max_new_tokens": 7, "sampling": "sample",
                              "params": {"temperature": 0.8}, "rng_base": 9},
                             {"prompt": [4, 4, 4], "max_new_tokens": 6, "sampling": "host",
                              "host_sampler": "perturb", "stop_at_eos": False}]}
    (tmp_path / "w.json").write_text(json.dumps(workload))
    d = Serve(tmp_path_factory.mktemp("rs-wheel"), f"rswheel{os.getpid()}", "--fake")
    try:
        d.wait_log("worker 0 ready (epoch 1")
        theirs = subprocess.run([*python(), "-m", "superfluid", "plan", "--name", d.name, str(tmp_path / "w.json")],
                                capture_output=True, text=True, timeout=120)
        mine = subprocess.run([str(plan), "--name", d.name, str(tmp_path / "w.json")], capture_output=True, text=True,
                              timeout=120)
    finally:
        d.close()
    assert theirs.returncode == 0 and mine.returncode == 0, theirs.stderr + mine.stderr
    got, want = json.loads(mine.stdout)["results"], json.loads(theirs.stdout)["results"]
    assert got == want and all(r["tokens"] for r in got)
