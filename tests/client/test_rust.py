"""The Rust planner crate (client/rust): generated declarations up to date
with the header, and `cargo test` against a live daemon."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

from superfluid.abi import gen_bindings

CRATE = os.path.join(os.path.dirname(__file__), "..", "..", "client", "rust")


def test_the_generated_bindings_match_the_header():
    assert gen_bindings.main(["--check"]) == 0


def test_cargo_test_against_a_live_daemon(tmp_path):
    if shutil.which("cargo") is None:
        pytest.skip("cargo is not installed: the Rust crate is not built here")
    if not glob.glob("/usr/share/cargo/registry/rmp-serde-*"):
        pytest.skip("Debian's crates (librust-rmp-serde-dev, librust-serde-dev) are not installed: .ci/run installs them")
    env = dict(os.environ, SUPERFLUID_PYTHON=sys.executable, CARGO_TARGET_DIR=str(tmp_path / "target"))
    r = subprocess.run(["cargo", "test", "--offline", "--quiet"], cwd=CRATE, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "3 passed" in r.stdout, r.stdout
