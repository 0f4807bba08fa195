"""The type checker sees the package the install makes: every `superfluid.*`
import resolves to the repository's own file.

The editable install maps superfluid.X to the root's folder X with an import
hook no static checker runs; `make test` runs mypy over build/typecheck, the
tree of links superfluid.testing.typecheck_tree makes from pyproject.toml.
Here: the tree names the files the interpreter imports, mypy reads the
annotations of abi/ and rings/ through it (a wrong call is an error), and
without the tree it finds nothing (the negative control)."""

from __future__ import annotations

import importlib.util
import tomllib
from pathlib import Path

import pytest

from superfluid.testing import typecheck_tree

api = pytest.importorskip("mypy.api")

ROOT = Path(__file__).resolve().parents[1]

SNIPPET = """
from superfluid.abi import Status
from superfluid.abi.plan_codec import decode_plan
from superfluid.abi.records import TickPlan
from superfluid.rings.queue import SlotQueue

reveal_type(decode_plan)
reveal_type(TickPlan().admits)
reveal_type(Status.RejectBounds)
reveal_type(SlotQueue.peek)
decode_plan(42)
"""


def _mypy(tmp_path: Path, mypy_path: str) -> tuple[str, int]:
    config = tmp_path / "mypy.toml"
    config.write_text(f'[tool.mypy]\nmypy_path = "{mypy_path}"\npython_version = "3.11"\n'
                      'follow_imports = "silent"\n')
    out, err, rc = api.run(["--config-file", str(config), "--cache-dir", str(tmp_path / "cache"),
                            "--no-error-summary", "-c", SNIPPET])
    return out + err, rc


def test_the_tree_links_each_package_to_the_folder_the_install_imports(tmp_path):
    tree = typecheck_tree.build(tmp_path / "typecheck") / "superfluid"
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert {"superfluid.abi", "superfluid.rings", "superfluid.executor"} <= set(packages)
    for name in packages:
        origin = Path(importlib.util.find_spec(name).origin)
        linked = tree.parent.joinpath(*name.split("."), "__init__.py")
        assert linked.resolve() == origin.resolve(), name
        assert origin.resolve().is_relative_to(ROOT), origin


def test_mypy_reads_the_repository_annotations_through_the_tree(tmp_path):
    tree = typecheck_tree.build(tmp_path / "typecheck")
    out, rc = _mypy(tmp_path, str(tree))
    assert "def (buf: bytes | bytearray | memoryview[int], *, in_process: bool =) -> tuple[int," in out, out
    # the records and enums the header makes at run time, as the generated stub states them
    assert "fallback=superfluid.abi.header_types.TickPlan]" in out
    assert "Sequence[tuple[int, tuple[int, int, int, int, fallback=superfluid.abi.header_types.RingRef]" in out
    assert "Literal[superfluid.abi.header_types.Status.RejectBounds]" in out
    assert "def (self: superfluid.rings.queue.SlotQueue, timeout: float | None =" in out
    # the negative control: a call the annotations forbid is an error
    assert 'Argument 1 to "decode_plan" has incompatible type "int"' in out, out
    assert rc == 1 and "Cannot find implementation" not in out, out


def test_without_the_tree_a_checker_finds_no_superfluid_module(tmp_path):
    out, rc = _mypy(tmp_path, str(tmp_path / "nothing"))
    assert 'Cannot find implementation or library stub for module named "superfluid.abi"' in out, out
    assert rc == 1
